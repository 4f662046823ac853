# syntax=docker/dockerfile:1
# The training image: CUDA + an exact Python, PyTorch, DeepSpeed and this project, the versions the tests run with.
#
#   docker build -t lmrecipe:0.1.0 --build-arg GIT_COMMIT="$(git rev-parse HEAD)" .
#   docker run --gpus all --rm -v "$PWD/data:/data" -v "$PWD/runs:/runs" lmrecipe:0.1.0 \
#       accelerate launch --multi_gpu --num_processes 8 train.py recipes/llama_1b.yaml data.path=/data/mine out_dir=/runs/1b
#
# tests/unit/test_diagnostics.py checks that the *_VERSION pins below equal pyproject.toml's and the Makefile's.
# For SLURM clusters, containers/lmrecipe.def builds the same environment with Apptainer.

FROM ghcr.io/astral-sh/uv:0.8.22 AS uv

FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ARG PYTHON_VERSION=3.11.7
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG DEEPSPEED_VERSION=0.19.8
ARG ACCELERATE_VERSION=1.15.0
ARG TRANSFORMERS_VERSION=5.23.0
ARG GIT_COMMIT=unknown
ARG IMAGE_TAG=lmrecipe:0.1.0-cuda12.8.1-torch2.13.0

# git: run_meta.json's commit when a checkout is mounted; build tools: DeepSpeed compiles its ops on first use.
# The distribution's tools are left unpinned (the base image's tag fixes the release); Python packages are pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends git ca-certificates build-essential libaio-dev \
    && rm -rf /var/lib/apt/lists/*

COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# An exact CPython build (python-build-standalone), not whatever the distribution ships.
RUN uv python install "${PYTHON_VERSION}" && uv venv --python "${PYTHON_VERSION}" /opt/venv
RUN uv pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/lmrecipe
COPY . /opt/lmrecipe
# Editable: the package finds ds_configs/ and recipes/ next to it (REPO_ROOT in lmrecipe/config/).
RUN uv pip install -e ".[test]" "torch==${TORCH_VERSION}" "deepspeed==${DEEPSPEED_VERSION}" \
        "accelerate==${ACCELERATE_VERSION}" "transformers==${TRANSFORMERS_VERSION}"

# run_meta.json records these (lmrecipe/observe/run_meta.py): which image, and which commit it was built from.
ENV LMRECIPE_IMAGE=${IMAGE_TAG} \
    LMRECIPE_GIT_COMMIT=${GIT_COMMIT} \
    PYTHONUNBUFFERED=1

CMD ["python", "train.py", "--help"]
