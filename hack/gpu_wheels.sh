#!/usr/bin/env bash
# Downloads, here (with a package registry), the wheels bulkhead needs at import on the GPU
# machine that has no network (see README, "Checking a GPU machine"): CPython 3.12,
# manylinux x86_64, the versions pinned in constraints.txt. torch, numpy, pyyaml,
# prometheus-client and the rest are installed there already; pydantic (with its core,
# annotated-types, typing-inspection, typing-extensions) and crc32c are not. setuptools and
# wheel (the build backend, this machine's version) build bulkhead's editable install there
# in an isolated environment when the machine's own setuptools is too old for
# pyproject.toml (setuptools < 77 rejects its SPDX `license`; 65 was seen to).
#
#   hack/gpu_wheels.sh            # -> hack/gpu-wheels/ (git-ignored), then prints the total size
#
# hack/gpu_check.sh installs them there with `pip install --no-index --find-links`.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=hack/gpu-wheels
PYTHON="${PYTHON:-.venv/bin/python}"
mkdir -p "$DEST"
"$PYTHON" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -c constraints.txt -d "$DEST" \
    pydantic pydantic-core annotated-types typing-inspection typing-extensions crc32c wheel \
    "setuptools==$("$PYTHON" -c 'import setuptools; print(setuptools.__version__)')"
ls -l "$DEST"
tree_bytes=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
wheel_bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
total=$((tree_bytes + wheel_bytes))
printf 'tracked files %.1f MiB + wheels %.1f MiB = %.1f MiB (limit 64 MiB)\n' \
    "$(echo "$tree_bytes / 1048576" | bc -l)" "$(echo "$wheel_bytes / 1048576" | bc -l)" \
    "$(echo "$total / 1048576" | bc -l)"
if [ "$total" -gt $((64 * 1048576)) ]; then
    echo "over the 64 MiB a GPU machine accepts" >&2
    exit 1
fi
