#!/usr/bin/env bash
# Agent-loop GRPO with a tool on CPU: SmolLM2-135M-Instruct learns to use a calculator for multi-digit
# products ("What is 347 * 86?"), which it cannot do in its head (0 of 32 held-out questions without the
# tool). multi_turn.enable runs every sample as a tool_agent conversation (hermes tool calls, the
# calculator from examples/tools/calculator.yaml); the reward is 1 when the model's own last
# "Answer: <n>" is the product. 2 DP workers, vLLM rollouts, remove-padding, dynamic batch size.
# Held-out metrics every 4 steps in $RUN_DIR/metrics.jsonl: val/score/mean (greedy), val/agent/*;
# draw them with examples/plot_agent_curve.py. See docs/agent_loop.md.
#   bash examples/run_grpo_tool_smollm2_cpu.sh                       # seed 1
#   SEED=2 RUN_DIR=outputs/smollm2_tool_seed2 bash examples/run_grpo_tool_smollm2_cpu.sh
#   bash examples/run_grpo_tool_smollm2_cpu.sh trainer.total_training_steps=4   # extra hydra overrides
# BALLAST_SKIP_SETUP=1 skips scripts/setup.sh (an existing venv). 2048 tokens per micro-batch: at 4096 the
# float32 logits over the 49152-token vocabulary pushed the two workers past 23 GiB in the first update.
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
RUN_DIR="${RUN_DIR:-outputs/smollm2_tool_seed$SEED}"
DATA="$BALLAST_CACHE_DIR/data/tool_arithmetic"
# Converts once per machine (about 40 s) and verifies logits against the GGUF model; then cached.
MODEL="$(python -c 'from ballast.models.from_gguf import real_model_dir; print(real_model_dir("float32"))')"
if [[ ! -f "$DATA/val.parquet" ]]; then
  python -c "from ballast.data import write_tool_arithmetic_dataset as w; print(w('$DATA', train_size=512, val_size=32, seed=0))"
fi
echo "[smollm2-tool] model $MODEL; data $DATA; seed $SEED; metrics in $RUN_DIR/metrics.jsonl"
python -m ballast.trainer.main \
  actor_rollout_ref.model.path="$MODEL" data.train_files="$DATA/train.parquet" data.val_files="$DATA/val.parquet" \
  data.max_prompt_length=192 data.max_response_length=96 data.train_batch_size=8 data.seed="$SEED" \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.seed="$SEED" \
  actor_rollout_ref.rollout.temperature=0.7 actor_rollout_ref.rollout.block_size=32 \
  actor_rollout_ref.rollout.mode=async actor_rollout_ref.rollout.multi_turn.enable=True \
  actor_rollout_ref.rollout.multi_turn.tool_config_path=examples/tools/calculator.yaml \
  actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3 \
  actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.optim.lr=1e-5 \
  actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048 \
  actor_rollout_ref.model.use_remove_padding=True algorithm.adv_estimator=grpo \
  actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false actor_rollout_ref.actor.fsdp_config.fsdp_size=1 \
  trainer.device=cpu trainer.n_gpus_per_node=2 trainer.balance_batch=True trainer.seed="$SEED" \
  trainer.logger='[console,jsonl]' trainer.project_name=ballast trainer.experiment_name="smollm2-tool-seed$SEED" \
  trainer.default_local_dir="$RUN_DIR" trainer.resume_mode=disable trainer.val_before_train=True \
  trainer.test_freq=4 trainer.save_freq=-1 trainer.total_training_steps=16 "$@"
