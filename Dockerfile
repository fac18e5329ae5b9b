# Ballast for GPU machines: CUDA 13 devel base (torch 2.14.0, which vllm 0.33.0 pins, is built for
# CUDA 13; the compiler is there for flash-attn), the `gpu` extra (vllm + flash-attn), Ballast installed
# from this repository, a non-root user, and the trainer as entrypoint.
#
# Host: an NVIDIA driver of the r580 branch or newer (CUDA 13.0 needs >= 580.65), plus the NVIDIA
# Container Toolkit for --gpus. Older drivers fail at the first CUDA call inside the container.
#
#   docker build -t ballast:gpu .                                   # flash-attn compiled for sm_90 (H100/H200)
#   docker build --build-arg FLASH_ATTN_CUDA_ARCHS="80;90" -t ballast:gpu .   # A100 and H100/H200
#   docker build --build-arg FLASH_ATTN_WHEEL=<url or path of a wheel built for torch 2.14 + CUDA 13> .
#   docker run --gpus all --ipc=host -v /data:/data ballast:gpu \
#       data.train_files=/data/train.parquet actor_rollout_ref.model.path=/data/model trainer.n_gpus_per_node=8
#   docker run --gpus all --ipc=host --network host --entrypoint scripts/ray_cluster.sh ballast:gpu head --block
#   docker run --gpus all --ipc=host --entrypoint scripts/gpu_smoke.sh ballast:gpu
#
# Model-written code (the python / code_interpreter tools, code-execution rewards) runs in a bubblewrap
# sandbox that needs unprivileged user namespaces, which Docker's default seccomp and AppArmor profiles
# refuse: add `--security-opt seccomp=unconfined --security-opt apparmor=unconfined` (or profiles that
# allow unshare/clone(CLONE_NEWUSER), mount and pivot_root), and on Ubuntu >= 23.10 hosts
# `sysctl kernel.apparmor_restrict_unprivileged_userns=0`. Without them those tools and rewards refuse
# to start (naming what is missing); runs without them are unaffected. The image's user is not root, so
# each sandbox's process cap is RLIMIT_NPROC (no cgroup needed). See docs/reliability.md.
#
# --ipc=host (or a large --shm-size, e.g. 16g): NCCL between the GPU worker processes of one node,
# Ray's object store and PyTorch's shared-memory tensors all live in /dev/shm, which Docker caps at
# 64 MB by default; NCCL then fails or hangs once two workers share a node.
#
# Not built on the CPU machines this project is developed on (no Docker engine there): the image name
# and package versions were checked against the registries, the build itself was not run.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

# flash-attn 2.8.3 has no prebuilt wheel for torch 2.14 + CUDA 13 (its setup.py would look for a
# "cu12" wheel, which does not match this torch), so it compiles. By default it compiles for four
# architectures (80;90;100;120) with one nvcc job of up to ~9 GB RAM per MAX_JOBS: hours and ~70 GB
# with 8 jobs. Build only the architectures you run on, with few jobs and nvcc threads.
ARG FLASH_ATTN_CUDA_ARCHS=90
ARG MAX_JOBS=4
ARG NVCC_THREADS=2
ARG FLASH_ATTN_WHEEL=""
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Ubuntu 24.04's Python is 3.12 (vllm 0.33 supports 3.11-3.14); a venv keeps pip away from the system one.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git ca-certificates build-essential \
       libseccomp2 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && pip install --upgrade pip setuptools wheel

# The heavy layers first, so that editing Ballast does not reinstall them: vllm brings its pinned
# CUDA torch; flash-attn builds against that torch (hence --no-build-isolation, which also means its
# build tools must already be here: ninja, or torch falls back to a serial build that ignores MAX_JOBS).
RUN pip install "vllm==0.33.0"
RUN pip install ninja packaging psutil einops \
    && if [ -n "${FLASH_ATTN_WHEEL}" ]; then pip install --no-deps "${FLASH_ATTN_WHEEL}"; \
       else FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS=${MAX_JOBS} \
            NVCC_THREADS=${NVCC_THREADS} pip install --no-build-isolation "flash-attn==2.8.3"; fi

WORKDIR /opt/ballast
COPY . /opt/ballast
# The tests come along (scripts/gpu_smoke.sh runs the gpu-marked ones inside the image).
RUN pip install -e ".[gpu,test]" \
    && python -c "import ballast, torch, vllm, flash_attn; print('ballast image: torch', torch.__version__, '| vllm', vllm.__version__)"

# Ubuntu 24.04 images already have a user with uid 1000 ("ubuntu"): use another uid.
ARG UID=10001
RUN useradd --create-home --uid ${UID} --shell /bin/bash ballast \
    && mkdir -p /opt/ballast/.cache /opt/ballast/outputs /opt/ballast/checkpoints \
    && chown -R ballast:ballast /opt/ballast/.cache /opt/ballast/outputs /opt/ballast/checkpoints
USER ballast
ENV HOME=/home/ballast \
    BALLAST_CACHE_DIR=/opt/ballast/.cache \
    HF_HOME=/home/ballast/.cache/huggingface \
    TOKENIZERS_PARALLELISM=false \
    RAY_USAGE_STATS_ENABLED=0 \
    VLLM_NO_USAGE_STATS=1

ENTRYPOINT ["python", "-m", "ballast.trainer.main"]
CMD ["--help"]
