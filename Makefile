# bulkhead: every target installs what it needs into .venv first (idempotent).
#   make run    install, then train the local MoE job with injected failures
#   make test   install, build the test control plane (cached), run the whole suite
#   make lint   ruff, and vulture for code nothing uses
#   make bench  every benchmark in its quick form, JSON into bench/results/

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_DIR ?= runs/local-3d
CHAOS ?= kill:worker=1@step=40,kill:worker=2@step=150
PYTEST_ARGS ?=

.PHONY: venv run test lint bench k8s cluster cluster-down crd clean e2e

# `python -P`: the repository root must never be on sys.path, or the folder operator/
# would shadow Python's standard operator module (installed, it is bulkhead.operator).
$(STAMP): pyproject.toml setup.py constraints.txt
	@test -x $(PY) || $(PYTHON) -P -m venv $(VENV)
	$(PY) -P -m pip install --quiet --upgrade pip
	$(PY) -P -m pip install --quiet -c constraints.txt -e '.[all,dev]'
	@touch $@

venv: $(STAMP)

run: venv
	$(VENV)/bin/bulkhead run examples/local-3d.yaml --chaos '$(CHAOS)' --run-dir $(RUN_DIR)

# The Kubernetes test binaries (etcd, kube-apiserver, ...) are built once per machine
# into ~/.cache/bulkhead and reused; see hack/build-k8s.sh.
k8s:
	@bash hack/build-k8s.sh

test: venv k8s
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The user's path on the test cluster: helm install, kubectl apply, faults; pods run as real
# processes through the test-only pod runner (hack/podrunner; needs root, ip, unshare).
# `make test` runs it too (about 2 minutes); see README "The user path, verified".
e2e: venv k8s
	$(VENV)/bin/pytest tests/e2e -v $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/vulture  # paths and exceptions: pyproject.toml, hack/vulture_whitelist.py

bench: venv
	@mkdir -p bench/results
	@set -e; for b in bench/[!_]*.py; do \
	  name=$$(basename $$b .py); \
	  echo "== $$name"; \
	  $(PY) $$b --quick --out bench/results/$$name.json; \
	done

cluster: venv k8s
	$(PY) hack/k8s_cluster.py up

cluster-down: venv
	$(PY) hack/k8s_cluster.py down

crd: venv
	$(VENV)/bin/bulkhead crd > crds/trainingjobs.bulkhead.dev.yaml

clean:
	rm -rf $(VENV) build *.egg-info runs bench/results .pytest_cache .ruff_cache
