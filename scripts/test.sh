#!/usr/bin/env bash
# Set up if needed, then run the whole test suite on this machine (CPU: everything except `gpu` tests).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh --real-model  # the real-model tests convert the bundled SmolLM2 GGUF
# shellcheck disable=SC1091
source .venv/bin/activate
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
MARK="not gpu"
if python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then MARK=""; fi
# Two pytest-xdist workers: the heavy tests run as two streams that fill each other's idle time (process
# and Ray start-ups, waits on subprocesses), the unit-test files wherever a worker is free (the groups:
# tests/testkit/streams.py). BALLAST_TEST_WORKERS=0 runs everything in this one process instead.
WORKERS="${BALLAST_TEST_WORKERS:-2}"
XDIST=()
if [[ "$WORKERS" != 0 ]]; then XDIST=(-n "$WORKERS"); fi
echo "[test] pytest ${MARK:+-m '$MARK'} ${XDIST[*]} $*"
if [[ -n "$MARK" ]]; then
  exec python -m pytest -m "$MARK" "${XDIST[@]}" "$@"
else
  exec python -m pytest "${XDIST[@]}" "$@"
fi
