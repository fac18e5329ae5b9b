# Ballast for GPU machines: CUDA 13 devel base (torch 2.14.0, which vllm 0.33.0 pins, is built for
# CUDA 13; the compiler is there for flash-attn), the `gpu` extra (vllm + flash-attn), Ballast installed
# from this repository, a non-root user, and the trainer as entrypoint.
#
#   docker build -t ballast:gpu .
#   docker run --gpus all --shm-size=16g -v /data:/data ballast:gpu \
#       data.train_files=/data/train.parquet actor_rollout_ref.model.path=/data/model trainer.n_gpus_per_node=8
#   docker run --gpus all --network host --entrypoint scripts/ray_cluster.sh ballast:gpu head --block
#   docker run --gpus all --entrypoint scripts/gpu_smoke.sh ballast:gpu
#
# Not built on the CPU machines this project is developed on (no Docker engine there): the image name
# and package versions were checked against the registries, the build itself was not run.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG MAX_JOBS=8
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Ubuntu 24.04's Python is 3.12 (vllm 0.33 supports 3.11-3.14); a venv keeps pip away from the system one.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && pip install --upgrade pip setuptools wheel

# The heavy layers first, so that editing Ballast does not reinstall them: vllm brings its pinned
# CUDA torch; flash-attn builds against that torch (hence --no-build-isolation) with MAX_JOBS compilers.
RUN pip install "vllm==0.33.0"
RUN MAX_JOBS=${MAX_JOBS} pip install --no-build-isolation "flash-attn>=2.7"

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
