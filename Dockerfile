# One image for every bulkhead process: bulkhead-operator, bulkhead-agent, bulkhead-worker
# (the trainer) and bulkhead-checkpointd (the checkpoint sidecar). The Deployment,
# DaemonSet and worker pods pick the process with `command:`. Every package version comes
# from constraints.txt, the same pins CI tests with.
#
#   docker build -t ghcr.io/bulkhead-dev/bulkhead:0.1.0 .                  # CUDA torch
#   docker build --build-arg VARIANT=cpu -t ghcr.io/bulkhead-dev/bulkhead:0.1.0-cpu .
#
# VARIANT=cpu installs torch's CPU-only build (same version, no CUDA libraries: a far
# smaller image) for CPU nodes, CI and the operator and agent, which never use a GPU.
# tests/packaging/test_dockerfile.py checks this file against pyproject.toml.

# The base image by digest, so a rebuild gets the very bytes that were tested (a tag moves).
# Update both parts together: docker buildx imagetools inspect python:3.11-slim
ARG PYTHON_IMAGE=python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cuda
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY constraints.txt pyproject.toml setup.py README.md LICENSE ./
COPY api/ api/
COPY operator/ operator/
COPY agent/ agent/
COPY trainer/ trainer/
COPY cli/ cli/
RUN python -m venv /opt/bulkhead \
 && if [ "${VARIANT}" = "cpu" ]; then \
      torch="$(grep -E '^torch==' constraints.txt)" \
      && /opt/bulkhead/bin/pip install --index-url "${TORCH_CPU_INDEX_URL}" "${torch}"; \
    elif [ "${VARIANT}" != "cuda" ]; then \
      echo "VARIANT must be cuda or cpu, got ${VARIANT}" >&2; exit 1; \
    fi \
 && /opt/bulkhead/bin/pip install -c constraints.txt ".[all]" \
 && /opt/bulkhead/bin/pip check

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/bulkhead/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    OMP_NUM_THREADS=1
COPY --from=build /opt/bulkhead /opt/bulkhead
# A fixed non-root user; the manifests run as 10001 with a read-only root filesystem.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin bulkhead
USER 10001
WORKDIR /home/bulkhead
CMD ["bulkhead-operator"]
