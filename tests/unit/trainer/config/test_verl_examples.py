"""verl's example command lines compose and validate unchanged (model and data paths aside).

The override lists are verl's GRPO (examples/grpo_trainer), PPO (examples/ppo_trainer) and DAPO
(recipe/dapo: clip-higher, token-mean, dynamic batch size, dynamic sampling, overlong buffer) scripts
as published, with `$HOME/...` paths replaced; `trainer.device=cuda` because they are GPU runs.
"""

import shlex
from pathlib import Path

import pytest

from ballast.trainer.run.builders import actor_loss_config
from ballast.trainer.config import ModelInfo, load_config
from ballast.trainer.run.run_plan import plan_run

MODEL = ModelInfo(num_attention_heads=28, num_key_value_heads=4, hidden_size=3584, num_hidden_layers=28,
                  intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768)
PATHS = ["data.train_files=/data/gsm8k/train.parquet", "data.val_files=/data/gsm8k/test.parquet", "trainer.device=cuda"]

GRPO = """algorithm.adv_estimator=grpo data.train_batch_size=1024 data.max_prompt_length=512
data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
actor_rollout_ref.model.path=/models/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","wandb"]
trainer.project_name=verl_grpo_example_gsm8k trainer.experiment_name=qwen2_7b_function_rm trainer.n_gpus_per_node=8
trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15"""

PPO = """algorithm.adv_estimator=gae data.train_batch_size=1024 data.max_prompt_length=512 data.max_response_length=512
data.filter_overlong_prompts=True data.truncation=error actor_rollout_ref.model.path=/models/deepseek-llm-7b-chat
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.rollout.tensor_model_parallel_size=4
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.4
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.ref.fsdp_config.param_offload=True
critic.optim.lr=1e-5 critic.model.use_remove_padding=True critic.model.path=/models/deepseek-llm-7b-chat
critic.model.enable_gradient_checkpointing=True critic.ppo_micro_batch_size_per_gpu=32
critic.model.fsdp_config.param_offload=False critic.model.fsdp_config.optimizer_offload=False
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","wandb"]
trainer.project_name=verl_example_gsm8k trainer.experiment_name=deepseek_llm_7b_function_rm trainer.n_gpus_per_node=8
trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=1 trainer.total_epochs=15"""

DAPO = """data.prompt_key=prompt data.truncation=left data.gen_batch_size=1536 data.max_prompt_length=2048 data.max_response_length=8192
data.train_batch_size=512 actor_rollout_ref.rollout.n=16 algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False
algorithm.kl_ctrl.kl_coef=0.0 actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0
actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28
actor_rollout_ref.actor.clip_ratio_c=10.0 algorithm.filter_groups.enable=True algorithm.filter_groups.max_num_gen_batches=10
algorithm.filter_groups.metric=acc actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.use_dynamic_bsz=True
actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=40960
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=40960 actor_rollout_ref.model.path=/models/Qwen2.5-7B
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.optim.lr_warmup_steps=10 actor_rollout_ref.actor.optim.weight_decay=0.1
actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.actor.grad_clip=1.0 actor_rollout_ref.actor.loss_agg_mode=token-mean
actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.80
actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.rollout.enable_chunked_prefill=True
actor_rollout_ref.rollout.max_num_batched_tokens=10240 actor_rollout_ref.rollout.temperature=1.0
actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1 actor_rollout_ref.rollout.val_kwargs.temperature=1.0
actor_rollout_ref.rollout.val_kwargs.top_p=0.7 actor_rollout_ref.rollout.val_kwargs.top_k=-1
actor_rollout_ref.rollout.val_kwargs.do_sample=True actor_rollout_ref.rollout.val_kwargs.n=1
actor_rollout_ref.ref.fsdp_config.param_offload=False actor_rollout_ref.ref.ulysses_sequence_parallel_size=1
actor_rollout_ref.actor.fsdp_config.fsdp_size=-1 reward_model.reward_manager=dapo
reward_model.overlong_buffer.enable=True reward_model.overlong_buffer.len=4096
reward_model.overlong_buffer.penalty_factor=1.0 trainer.logger=["console","wandb"] trainer.project_name=DAPO
trainer.experiment_name=DAPO-Qwen2.5-7B trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.val_before_train=True
trainer.test_freq=5 trainer.save_freq=5 trainer.total_epochs=1 trainer.resume_mode=auto"""


@pytest.mark.parametrize("name, line", [("grpo", GRPO), ("ppo", PPO), ("dapo", DAPO)])
def test_verl_example_command_lines_validate_unchanged(name, line):
    cfg = load_config(PATHS + line.split())
    plan = plan_run(cfg, MODEL, total_steps=100)
    spec = plan.specs.actor_rollout_ref
    assert plan.sizes.use_critic == (name == "ppo")
    if name == "ppo":
        assert plan.specs.critic.critic.cpu_offload is False
    if name == "grpo":
        assert spec.ref.cpu_offload is True and actor_loss_config(cfg, plan.old_log_probs).use_kl_loss
    if name == "dapo":
        loss = actor_loss_config(cfg, plan.old_log_probs)
        assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.clip_ratio_c) == (0.2, 0.28, 10.0)
        assert cfg.algorithm.filter_groups.metric == "acc" and cfg.reward_model.overlong_buffer.len == 4096
        assert cfg.data.gen_batch_size == 1536


def test_the_dapo_example_script_is_verls_dapo_command_line():
    """examples/run_dapo_gsm8k.sh runs the DAPO line above with only the model and data paths changed."""
    script = (Path(__file__).resolve().parents[4] / "examples" / "run_dapo_gsm8k.sh").read_text()
    command = script[script.index("python -m ballast.trainer.main"):].replace("\\\n", " ")
    args = [arg.replace("$MODEL", "/models/Qwen2.5-7B").replace("$DATA", "/data/gsm8k")
            for arg in shlex.split(command)[3:] if arg != "$@"]
    assert args == PATHS[:2] + DAPO.split()
