#!/usr/bin/env bash
# RLHF on CPU, offline: a tiny reward model trained by Bradley-Terry on synthetic preference pairs of
# the quickstart task (examples/train_reward_model_repeat.py), then GRPO (ALGO=grpo, default) or PPO
# (ALGO=ppo: critic + GAE + KL loss) against it; SEED picks the run's seeds (trainer.seed and
# actor_rollout_ref.rollout.seed, the base of every sampling seed). The reward is the reward
# model's score alone; the rule score is logged beside it (reward_extra/rule_score, and on the
# held-out prompts val-aux/.../rule_score). Results: docs/reward_models.md.
#   bash examples/run_rlhf_tiny.sh [hydra overrides]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
source .venv/bin/activate
export OMP_NUM_THREADS=1 RAY_USAGE_STATS_ENABLED=0 WANDB_MODE="${WANDB_MODE:-offline}"
ALGO="${ALGO:-grpo}" SEED="${SEED:-1}"
QS=.cache/quickstart
[[ -f "$QS/model/config.json" ]] || python -m ballast.models --out "$QS/model" --preset tiny --seed 0
[[ -f "$QS/data/train.parquet" ]] || python examples/data/make_synthetic.py --out "$QS/data" --train-size 2048 \
  --val-size 64 --k-median 8 --k-max 60 --symbols '#'
[[ -f "$QS/rm/rm_eval.json" ]] || OMP_NUM_THREADS=2 python examples/train_reward_model_repeat.py --out "$QS/rm" --steps 400
ALGO_ARGS=()
if [[ "$ALGO" == ppo ]]; then
  ALGO_ARGS=(algorithm.adv_estimator=gae algorithm.gamma=1.0 algorithm.lam=0.95
    actor_rollout_ref.rollout.n=2 data.train_batch_size=32 actor_rollout_ref.actor.ppo_mini_batch_size=16
    critic.optim.lr=1e-3 critic.use_dynamic_bsz=False critic.ppo_micro_batch_size_per_gpu=8
    critic.forward_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001 trainer.critic_warmup=2)
fi
python -m ballast.trainer.main --config-name quickstart "${ALGO_ARGS[@]}" \
  reward.reward_model.enable=True reward.reward_model.model_path="$QS/rm" \
  trainer.seed="$SEED" actor_rollout_ref.rollout.seed="$SEED" trainer.experiment_name="rlhf-$ALGO-seed$SEED" \
  trainer.default_local_dir="outputs/rlhf_${ALGO}_seed$SEED" \
  trainer.resume_mode=disable trainer.move_old_run_aside=true "$@"
