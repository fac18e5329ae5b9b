"""Override lists for the end-to-end runs (a fast 2-worker GRPO on the tiny task)."""

import os


def overrides(task, run_dir, *extra):
    """A fast 2-worker GRPO configuration on the tiny task."""
    return [
        f"actor_rollout_ref.model.path={task['model']}", f"data.train_files={task['train']}",
        f"data.val_files={task['val']}", f"trainer.default_local_dir={run_dir}",
        "data.max_prompt_length=32", "data.max_response_length=24", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.name=hf",
        "algorithm.adv_estimator=grpo", "trainer.device=cpu", "trainer.n_gpus_per_node=2",
        "trainer.logger=[jsonl]", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.resume_mode=disable", "trainer.total_training_steps=2", "trainer.worker_timeout_s=600",
        *extra,
    ]


def run_dir(tmp_path, name):
    path = os.path.join(str(tmp_path), name)
    os.makedirs(path, exist_ok=True)
    return path
