# syntax=docker/dockerfile:1.7
# Container images of grpo-operator, one build target per role (see docs/install-eks.md):
#
#   docker build --target operator -t ghcr.io/grpo-operator/operator:0.1.0 .   # kopf operator, no torch
#   docker build --target trainer  -t ghcr.io/grpo-operator/trainer:0.1.0  .   # CUDA, EFA, NVSHMEM, DeepEP
#   docker build --target rollout  -t ghcr.io/grpo-operator/rollout:0.1.0  .   # CUDA, EFA, vLLM
#
# Entrypoints are the project's own commands, the same the renderer writes into pod specs
# (grpo_operator.render.pods.COMMANDS) and the chart runs; tests/unit/test_dockerfile.py
# keeps them in line. Versions are build arguments so a fleet can move without a code change.

ARG PYTHON_VERSION=3.12
ARG CUDA_VERSION=12.9.1
ARG CUDA_BASE=nvidia/cuda:${CUDA_VERSION}-cudnn-devel-ubuntu24.04

# ---------------------------------------------------------------------------------------
# wheel: the project's one distribution (three import packages), built once.
FROM python:${PYTHON_VERSION}-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainers ./trainers
COPY rollout ./rollout
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------
# operator: the kopf operator. Base dependencies only (no torch, no CUDA); non-root, and
# nothing is written outside /tmp, so the chart runs it with a read-only root filesystem.
FROM python:${PYTHON_VERSION}-slim AS operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir /wheels/grpo_operator-*.whl
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["grpo-operator", "operator"]

# ---------------------------------------------------------------------------------------
# cuda-efa: CUDA + the EFA userspace (libfabric, and the aws-ofi-nccl plugin the installer
# ships under /opt/amazon/ofi-nccl) + a Python virtualenv. Shared by trainer and rollout.
FROM ${CUDA_BASE} AS cuda-efa
ARG EFA_INSTALLER_VERSION=1.43.2
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      ca-certificates curl git build-essential cmake ninja-build pkg-config \
      python3 python3-dev python3-venv libnuma-dev libibverbs-dev rdma-core \
 && rm -rf /var/lib/apt/lists/*
# --skip-kmod: the EFA kernel module belongs to the node (EKS AMI), not to the image.
WORKDIR /tmp/efa
RUN curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
      | tar -xz --strip-components=1 \
 && ./efa_installer.sh -y -g -d --skip-kmod --skip-limit-conf --no-verify \
 && rm -rf /tmp/efa/* /var/lib/apt/lists/* \
 && test -f /opt/amazon/ofi-nccl/lib/libnccl-net.so || test -f /opt/amazon/ofi-nccl/lib/x86_64-linux-gnu/libnccl-net.so
ENV PATH=/opt/venv/bin:/opt/amazon/efa/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu:/opt/amazon/efa/lib:/usr/local/cuda/lib64 \
    FI_PROVIDER=efa \
    NCCL_DEBUG=INFO \
    NCCL_DEBUG_SUBSYS=INIT,NET
WORKDIR /
RUN python3 -m venv /opt/venv && pip install --no-cache-dir --upgrade "pip==25.3" "setuptools==80.9.0" "wheel==0.45.1"

# ---------------------------------------------------------------------------------------
# ep-build: GDRCopy, NVSHMEM over libfabric (EFA) and DeepEP for Hopper (sm_90).
FROM cuda-efa AS ep-build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu129
ARG GDRCOPY_VERSION=2.5.1
ARG NVSHMEM_VERSION=3.8.0
ARG DEEPEP_REF=v1.2.1
ENV TORCH_CUDA_ARCH_LIST=9.0 \
    CUDA_HOME=/usr/local/cuda
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /build
RUN curl -fsSL "https://github.com/NVIDIA/gdrcopy/archive/refs/tags/v${GDRCOPY_VERSION}.tar.gz" | tar -xz \
 && make -C "gdrcopy-${GDRCOPY_VERSION}" -j"$(nproc)" prefix=/opt/gdrcopy CUDA=/usr/local/cuda lib lib_install
# NVSHMEM with the libfabric transport: DeepEP's internode kernels reach EFA through it
# (NVSHMEM_REMOTE_TRANSPORT=libfabric, NVSHMEM_LIBFABRIC_PROVIDER=efa at run time).
RUN curl -fsSL "https://github.com/NVIDIA/nvshmem/archive/refs/tags/v${NVSHMEM_VERSION}-0.tar.gz" | tar -xz \
 && cmake -S "nvshmem-${NVSHMEM_VERSION}-0" -B nvshmem-build -G Ninja \
      -DCMAKE_INSTALL_PREFIX=/opt/nvshmem \
      -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DNVSHMEM_LIBFABRIC_SUPPORT=ON -DLIBFABRIC_HOME=/opt/amazon/efa \
      -DNVSHMEM_USE_GDRCOPY=ON -DGDRCOPY_HOME=/opt/gdrcopy \
      -DNVSHMEM_IBGDA_SUPPORT=OFF -DNVSHMEM_MPI_SUPPORT=OFF -DNVSHMEM_SHMEM_SUPPORT=OFF \
      -DNVSHMEM_PMIX_SUPPORT=OFF -DNVSHMEM_USE_NCCL=OFF \
      -DNVSHMEM_BUILD_TESTS=OFF -DNVSHMEM_BUILD_EXAMPLES=OFF -DNVSHMEM_BUILD_PYTHON_LIB=OFF \
 && cmake --build nvshmem-build -j"$(nproc)" \
 && cmake --install nvshmem-build
RUN mkdir deepep \
 && curl -fsSL "https://github.com/deepseek-ai/DeepEP/archive/refs/tags/${DEEPEP_REF}.tar.gz" \
      | tar -xz --strip-components=1 -C deepep \
 && NVSHMEM_DIR=/opt/nvshmem pip wheel --no-cache-dir --no-build-isolation --no-deps --wheel-dir /wheels ./deepep

# ---------------------------------------------------------------------------------------
# trainer: torch, DeepSpeed (ops JIT-built on first use, so nvcc stays), DeepEP, NVSHMEM,
# GDRCopy and the project with its trainer and storage (s3fs, pyarrow) extras. NCCL is raised past torch's pin to a release
# whose GIN path DeepEP v2 uses through aws-ofi-nccl (NCCL keeps its ABI across 2.x).
FROM cuda-efa AS trainer
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu129
ARG NCCL_VERSION=2.32.3
ENV TORCH_CUDA_ARCH_LIST=9.0 \
    CUDA_HOME=/usr/local/cuda \
    DS_BUILD_OPS=0 \
    TORCH_EXTENSIONS_DIR=/tmp/torch_extensions \
    NVSHMEM_HOME=/opt/nvshmem \
    LD_LIBRARY_PATH=/opt/nvshmem/lib:/opt/gdrcopy/lib:/opt/amazon/ofi-nccl/lib:/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu:/opt/amazon/efa/lib:/usr/local/cuda/lib64
COPY --from=ep-build /opt/gdrcopy /opt/gdrcopy
COPY --from=ep-build /opt/nvshmem /opt/nvshmem
RUN --mount=type=bind,from=ep-build,source=/wheels,target=/ep-wheels \
    --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" \
      "torch==${TORCH_VERSION}" /ep-wheels/deep_ep-*.whl "$(ls /wheels/grpo_operator-*.whl)[trainer,storage]" \
 && pip install --no-cache-dir --no-deps "nvidia-nccl-cu12==${NCCL_VERSION}" \
 && python -c "import torch, deepspeed, deep_ep, grpo_trainer, grpo_rollout, s3fs, pyarrow; print(torch.cuda.nccl.version())"
RUN useradd --uid 1000 --create-home grpo
USER 1000
WORKDIR /home/grpo
ENTRYPOINT ["python", "-m", "grpo_trainer", "train"]

# ---------------------------------------------------------------------------------------
# rollout: vLLM generation servers. vLLM pins its own torch, so it gets its own image
# rather than sharing the trainer's (weight sync speaks the wire protocol, not Python).
FROM cuda-efa AS rollout
ARG VLLM_VERSION=0.33.0
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir "vllm==${VLLM_VERSION}" "$(ls /wheels/grpo_operator-*.whl)[gpu,storage]" \
 && python -c "import vllm, grpo_rollout, s3fs, pyarrow"
RUN useradd --uid 1000 --create-home grpo
USER 1000
WORKDIR /home/grpo
EXPOSE 8000
ENTRYPOINT ["python", "-m", "grpo_rollout", "serve"]
