#!/usr/bin/env bash
# The one command to run on a GPU machine without network (README, "Checking a GPU
# machine"): installs the wheels hack/gpu_wheels.sh downloaded and bulkhead itself
# (editable, no dependencies, nothing fetched), then runs
# bench/gpu_check.py, writing gpu_check.json and gpu_check.log into $OUT.
#
#   OUT=/path/to/results hack/gpu_check.sh [--quick]
#
# Exit code: the check's (0 = every check passed).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
if ! ls hack/gpu-wheels/*.whl >/dev/null 2>&1; then
    echo "hack/gpu-wheels/ is empty: run hack/gpu_wheels.sh where there is network" >&2
    exit 2
fi
runtime=$(ls hack/gpu-wheels/*.whl | grep -vE '/(setuptools|wheel)-')
{
    "$PYTHON" -m pip install --no-index --find-links hack/gpu-wheels $runtime
    # The machine's own setuptools first; if it is too old for pyproject.toml, an isolated
    # build environment from the downloaded setuptools and wheel (still no network).
    "$PYTHON" -m pip install --no-index --no-deps --no-build-isolation -e . ||
        "$PYTHON" -m pip install --no-index --find-links hack/gpu-wheels --no-deps -e .
} >"$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log" >&2; exit 2; }
if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "torch sees no CUDA device here: nothing to check (the driver? CUDA_VISIBLE_DEVICES?)" >&2
    exit 2
fi
set +e
"$PYTHON" -P bench/gpu_check.py --out "$OUT/gpu_check.json" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
