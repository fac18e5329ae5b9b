#!/usr/bin/env bash
# PPO (critic + GAE) on the tiny model and the synthetic task, on CPU: the quickstart's setup with a
# value model, static micro-batches for the critic and a KL loss against the reference model.
#   bash examples/run_ppo_tiny.sh [hydra overrides]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate
export OMP_NUM_THREADS=1 RAY_USAGE_STATS_ENABLED=0 WANDB_MODE="${WANDB_MODE:-offline}"
QS=.cache/quickstart
[[ -f "$QS/model/config.json" ]] || python -m ballast.models --out "$QS/model"
[[ -f "$QS/data/train.parquet" ]] || python examples/data/make_synthetic.py --out "$QS/data" --train-size 2048 \
  --val-size 64 --k-median 8 --k-max 60 --symbols '#'
python -m ballast.trainer.main --config-name quickstart \
  algorithm.adv_estimator=gae algorithm.gamma=1.0 algorithm.lam=0.95 \
  actor_rollout_ref.rollout.n=2 data.train_batch_size=32 actor_rollout_ref.actor.ppo_mini_batch_size=16 \
  critic.optim.lr=1e-3 critic.use_dynamic_bsz=False critic.ppo_micro_batch_size_per_gpu=8 \
  critic.forward_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001 \
  trainer.critic_warmup=2 trainer.experiment_name=ppo-tiny trainer.default_local_dir=outputs/ppo_tiny \
  trainer.resume_mode=disable trainer.move_old_run_aside=true "$@"
