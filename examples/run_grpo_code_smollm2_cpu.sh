#!/usr/bin/env bash
# GRPO on a coding task with a code-execution reward, on CPU: SmolLM2-135M-Instruct writes short Python
# functions ("Write a Python function `f(x)` that returns x plus 7.") and each answer's ```python block
# runs against five hidden tests in the OS-level sandbox (ballast/data/code_reward.py: bubblewrap, no
# network, no host files, 2 s per test, 2 at a time); the reward is the pass rate. The data is built
# offline (ballast/data/coding.py; the held-out split asks for constants and letters the train split
# never does). 2 DP workers, vLLM rollouts, remove-padding, dynamic batch size. The run refuses to start
# where the sandbox cannot be set up (docs/reliability.md, "Model-written code").
# Held-out greedy pass rate (val/score/mean, 32 requests) every 4 steps in $RUN_DIR/metrics.jsonl; draw it
# with examples/plot_val_curve.py; reward_extra/* say why programs failed (no_code, wrong_answers, ...).
#   bash examples/run_grpo_code_smollm2_cpu.sh                       # seed 1
#   SEED=2 RUN_DIR=outputs/smollm2_code_seed2 bash examples/run_grpo_code_smollm2_cpu.sh
#   bash examples/run_grpo_code_smollm2_cpu.sh trainer.total_training_steps=4   # extra hydra overrides
# BALLAST_SKIP_SETUP=1 skips scripts/setup.sh (an existing venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[[ "${BALLAST_SKIP_SETUP:-0}" == 1 ]] || bash scripts/setup.sh --real-model
# shellcheck disable=SC1091
source .venv/bin/activate
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
export WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export BALLAST_CACHE_DIR="${BALLAST_CACHE_DIR:-$ROOT/.cache}"
export VLLM_CACHE_ROOT="$BALLAST_CACHE_DIR/vllm" TORCHINDUCTOR_CACHE_DIR="$BALLAST_CACHE_DIR/inductor"
SEED="${SEED:-1}"
RUN_DIR="${RUN_DIR:-outputs/smollm2_code_seed$SEED}"
DATA="$BALLAST_CACHE_DIR/data/coding"
# Converts once per machine (about 40 s) and verifies logits against the GGUF model; then cached.
MODEL="$(python -c 'from ballast.models.from_gguf import real_model_dir; print(real_model_dir("float32"))')"
if [[ ! -f "$DATA/val.parquet" ]]; then
  python -m ballast.data.coding "$DATA" --train-size 512 --val-size 32 --seed 0
fi
echo "[smollm2-code] model $MODEL; data $DATA; seed $SEED; metrics in $RUN_DIR/metrics.jsonl"
python -m ballast.trainer.main \
  actor_rollout_ref.model.path="$MODEL" data.train_files="$DATA/train.parquet" data.val_files="$DATA/val.parquet" \
  data.max_prompt_length=96 data.max_response_length=64 data.train_batch_size=8 data.seed="$SEED" \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.seed="$SEED" \
  actor_rollout_ref.rollout.temperature=0.6 actor_rollout_ref.rollout.block_size=32 \
  actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.optim.lr=1e-5 \
  actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048 \
  actor_rollout_ref.model.use_remove_padding=True algorithm.adv_estimator=grpo \
  actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false actor_rollout_ref.actor.fsdp_config.fsdp_size=1 \
  trainer.device=cpu trainer.n_gpus_per_node=2 trainer.balance_batch=True trainer.seed="$SEED" \
  trainer.logger='[console,jsonl]' trainer.project_name=ballast trainer.experiment_name="smollm2-code-seed$SEED" \
  trainer.default_local_dir="$RUN_DIR" trainer.resume_mode=disable trainer.val_before_train=True \
  trainer.test_freq=4 trainer.save_freq=-1 trainer.total_training_steps=12 "$@"
