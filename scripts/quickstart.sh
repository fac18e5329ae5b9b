#!/usr/bin/env bash
# The README's first command: set up if needed, build the tiny model and the synthetic task offline,
# then train GRPO on CPU (real vLLM rollouts, 2 DP workers, dynamic batch size, remove-padding,
# balance_batch) and print how the mean score moved. Extra arguments are hydra overrides, e.g.
#   bash scripts/quickstart.sh trainer.total_training_steps=10 actor_rollout_ref.rollout.name=hf
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
export WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export BALLAST_CACHE_DIR="$ROOT/.cache" VLLM_CACHE_ROOT="$ROOT/.cache/vllm" TORCHINDUCTOR_CACHE_DIR="$ROOT/.cache/inductor"
QS=.cache/quickstart
if [[ ! -f "$QS/model/config.json" ]]; then
  echo "[quickstart] building the tiny Qwen2 model and tokenizer in $QS/model"
  python -m ballast.models --out "$QS/model" --preset tiny --seed 0
fi
if [[ ! -f "$QS/data/train.parquet" ]]; then
  echo "[quickstart] writing the synthetic repeat task to $QS/data"
  python examples/data/make_synthetic.py --out "$QS/data" --train-size 2048 --val-size 64 --k-median 8 --k-max 60 --symbols '#'
fi
RUN_DIR=outputs/quickstart
for arg in "$@"; do  # a trainer.default_local_dir override moves the run (and the summary below) elsewhere
  [[ "$arg" == trainer.default_local_dir=* ]] && RUN_DIR="${arg#trainer.default_local_dir=}"
done
echo "[quickstart] training GRPO on CPU; metrics in $RUN_DIR/metrics.jsonl"
# A rerun starts over; the previous run moves to $RUN_DIR.old-<time> rather than being overwritten.
python -m ballast.trainer.main --config-name quickstart trainer.resume_mode=disable trainer.move_old_run_aside=true \
  "trainer.default_local_dir=$RUN_DIR" "$@"
python - "$RUN_DIR/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in rows if "critic/score/mean" in r]
val = [r for r in rows if "val/score/mean" in r]
if train:
    first, last = train[:5], train[-5:]
    mean = lambda rs: sum(r["critic/score/mean"] for r in rs) / len(rs)
    print(f"[quickstart] mean training score: first 5 steps {mean(first):.3f} -> last 5 steps {mean(last):.3f}")
if val:
    print(f"[quickstart] validation score (greedy): step {val[0]['step']} {val[0]['val/score/mean']:.3f} -> "
          f"step {val[-1]['step']} {val[-1]['val/score/mean']:.3f}")
PY
