#!/usr/bin/env bash
# GRPO on GSM8K with a local Hugging Face model (no downloads: bring the model directory and the data).
#   python examples/data/gsm8k.py --input /path/gsm8k/train.parquet --output data/gsm8k/train.parquet --split train
#   python examples/data/gsm8k.py --input /path/gsm8k/test.parquet  --output data/gsm8k/test.parquet  --split test
#   MODEL=/path/to/Qwen2.5-0.5B-Instruct bash examples/run_grpo_gsm8k.sh trainer.n_gpus_per_node=8
set -euo pipefail
: "${MODEL:?set MODEL to a local Hugging Face model directory}"
DATA="${DATA:-data/gsm8k}"
python -m ballast.trainer.main \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=1024 \
  actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.actor.optim.lr=1e-6 \
  algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=5 \
  actor_rollout_ref.actor.ppo_mini_batch_size=64 \
  actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
  actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
  trainer.balance_batch=True trainer.logger='[console,wandb,jsonl]' trainer.project_name=ballast \
  trainer.experiment_name=grpo-gsm8k trainer.test_freq=10 trainer.save_freq=50 trainer.total_epochs=15 "$@"
