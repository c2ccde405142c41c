# One image for every bulkhead process: bulkhead-operator, bulkhead-agent, bulkhead-worker
# (the trainer) and bulkhead-checkpointd (the checkpoint sidecar). The Deployment,
# DaemonSet and worker pods pick the process with `command:`.
#
#   docker build -t ghcr.io/bulkhead-dev/bulkhead:0.1.0 .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t bulkhead:cpu .

FROM python:3.11-slim AS build
# torch from PyPI is the CUDA build on x86_64; point this at the CPU index for small images.
ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY api/ api/
COPY operator/ operator/
COPY agent/ agent/
COPY trainer/ trainer/
COPY cli/ cli/
RUN python -m venv /opt/bulkhead \
 && /opt/bulkhead/bin/pip install --extra-index-url "${TORCH_INDEX_URL}" ".[all]"

FROM python:3.11-slim
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
