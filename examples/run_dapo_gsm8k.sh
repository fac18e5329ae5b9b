#!/usr/bin/env bash
# DAPO (clip-higher, token-mean loss, dynamic sampling on acc, overlong reward shaping) on GSM8K: verl's
# DAPO recipe command line (Qwen2.5-7B, 8 GPUs) with only the model and data paths changed. The GSM8K
# score returns a number, which reward_model.reward_manager=dapo records as acc: the groups are filtered
# on it and validation reports it as its core variable (val-core/openai/gsm8k/acc/mean@1).
#   python examples/data/gsm8k.py --input /path/gsm8k/train.parquet --output data/gsm8k/train.parquet --split train
#   python examples/data/gsm8k.py --input /path/gsm8k/test.parquet  --output data/gsm8k/test.parquet  --split test
#   MODEL=/path/to/Qwen2.5-7B bash examples/run_dapo_gsm8k.sh
# The run ends when trainer.total_epochs of data is used up (dynamic sampling draws several generation
# batches per step, so that is before total_epochs x batches per epoch steps), as verl's recipe does.
set -euo pipefail
: "${MODEL:?set MODEL to a local Hugging Face model directory}"
DATA="${DATA:-data/gsm8k}"
python -m ballast.trainer.main \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  data.prompt_key=prompt data.truncation=left data.gen_batch_size=1536 data.max_prompt_length=2048 \
  data.max_response_length=8192 data.train_batch_size=512 actor_rollout_ref.rollout.n=16 \
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.0 \
  actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0 \
  actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \
  actor_rollout_ref.actor.clip_ratio_c=10.0 algorithm.filter_groups.enable=True \
  algorithm.filter_groups.max_num_gen_batches=10 algorithm.filter_groups.metric=acc \
  actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.use_dynamic_bsz=True \
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=40960 \
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=40960 actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.optim.lr_warmup_steps=10 actor_rollout_ref.actor.optim.weight_decay=0.1 \
  actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.fsdp_config.param_offload=False \
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.grad_clip=1.0 actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.80 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.rollout.enable_chunked_prefill=True \
  actor_rollout_ref.rollout.max_num_batched_tokens=10240 actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1 actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
  actor_rollout_ref.rollout.val_kwargs.top_p=0.7 actor_rollout_ref.rollout.val_kwargs.top_k=-1 \
  actor_rollout_ref.rollout.val_kwargs.do_sample=True actor_rollout_ref.rollout.val_kwargs.n=1 \
  actor_rollout_ref.ref.fsdp_config.param_offload=False actor_rollout_ref.ref.ulysses_sequence_parallel_size=1 \
  actor_rollout_ref.actor.fsdp_config.fsdp_size=-1 reward_model.reward_manager=dapo \
  reward_model.overlong_buffer.enable=True reward_model.overlong_buffer.len=4096 \
  reward_model.overlong_buffer.penalty_factor=1.0 trainer.logger='["console","wandb"]' trainer.project_name=DAPO \
  trainer.experiment_name=DAPO-Qwen2.5-7B trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.val_before_train=True \
  trainer.test_freq=5 trainer.save_freq=5 trainer.total_epochs=1 trainer.resume_mode=auto "$@"
