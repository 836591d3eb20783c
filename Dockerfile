# syntax=docker/dockerfile:1
# One image for both roles: the project installed, its entry points runnable from the working directory.
#
#   docker build -t aligner:0.1.0 .
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 -t aligner:0.1.0-cu126 .
#
#   docker run --gpus all -p 8001-8002:8001-8002 aligner:0.1.0      # the critic/reward server (default command)
#   docker run --gpus all aligner:0.1.0 python examples/train_actor.py critic.url=grpc://HOST:8001
#   docker run aligner:0.1.0 python -m aligner.critic.wait --url grpc://HOST:8001
#
# The base image is any CUDA image on Ubuntu 24.04 or newer: its apt Python (3.12) is one that
# transformers 5 (Python >= 3.11) and PyTriton's bundled Triton (glibc >= 2.35) accept. The CUDA
# libraries come with the torch wheel; the base image only needs to match the host's driver.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
FROM ${BASE_IMAGE}

# The torch release `make setup` installs (the lower bound of pyproject.toml's torch range); another
# wheel index picks a build for another CUDA version.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=

# XDG_CACHE_HOME: PyTriton copies its Triton workspace there at every start; /tmp is writable
# whatever user the pod runs as.
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    XDG_CACHE_HOME=/tmp/aligner-cache

# python3-dev brings libpython3.X.so, which Triton's Python backend stub loads;
# tini runs as PID 1 and passes SIGTERM on to the server (which saves before it exits).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev tini ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip

WORKDIR /workspace/aligner

# Dependencies in their own layers, so that editing the code does not download them again:
# torch first and exactly pinned, then the rest of pyproject.toml's dependencies with the server
# extra (PyTriton, which the default command runs, and the numpy < 2 it requires).
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
RUN mkdir -p aligner && touch aligner/__init__.py \
    && pip install ".[server]" \
    && pip uninstall -y aligner-rlhf \
    && rm -rf aligner build

# The project itself (its Hydra configs are package data: aligner/configs), and the entry points.
COPY aligner ./aligner
RUN pip install --no-deps . && rm -rf build
COPY servers ./servers
COPY examples ./examples

# An unprivileged user to run as (the Kubernetes recipe requires it: runAsNonRoot, runAsUser 10001).
# HOME is /tmp, which the recipe mounts writable over a read-only root filesystem.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp aligner
ENV HOME=/tmp
USER 10001

# gRPC and metrics ports of the critic server (aligner/configs/critic.yaml: server.*_port). HTTP is
# off (server.http_port null; README.md, "What the server trusts"). Bound to 0.0.0.0, the server
# requires a run token: give it server.run_token_file (a mounted file) or $ALIGNER_RUN_TOKEN, else it
# makes <log.dir>/run_token (mode 0600), which the actor then needs as critic.run_token_file.
EXPOSE 8001 8002
# The default command serves the digits preset (a tiny critic and the sort task's reward); a real
# run names its own preset or keys: docker run <image> python servers/serve_critic.py +server_recipe=...

ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["python", "servers/serve_critic.py", "+server_recipe=digits", "server.host=0.0.0.0", "server.metrics_port=8002"]
