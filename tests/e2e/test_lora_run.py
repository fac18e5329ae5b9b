"""A LoRA run whose adapter never reaches the rollout stops, naming the cause (HF rollout: the check is
the same code for every backend, and the matrix rows (tests/e2e/test_rollout_matrix.py) show it can
tell vLLM serving the adapter from vLLM serving the base model). The LoRA runs that train (GRPO with a
KL loss against the adapter-off reference on vLLM, PPO with adapters on actor and critic and merged
sync, partial rollouts under a merged adapter) are rows of that matrix."""

import os
from pathlib import Path

from ballast.trainer.main import EXIT_WORKER_FAILED

from testkit.e2e import killed_on_exit, last_line, run_dir, start_trainer

LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=2e-2"]
BROKEN_SYNC = str(Path(__file__).resolve().parents[1] / "testkit" / "broken_sync")


def test_a_run_whose_adapter_never_reaches_the_rollout_stops_naming_the_cause(tiny_task, tmp_path):
    # The HF rollout (start_trainer's default) holds its own copy of the model, so a dropped adapter
    # leaves it serving the base weights, as a dropped vLLM load would; a vLLM start-up here would only
    # add ~25 s: vLLM's side of the check (it tells the served adapter from the base) is asserted by the
    # matrix's LoRA rows.
    path = run_dir(tmp_path, "broken_sync")
    env = {"PYTHONPATH": os.pathsep.join([BROKEN_SYNC, os.environ.get("PYTHONPATH", "")])}
    # one worker: the check runs on each rank's own rollout, a second rank would only repeat it
    proc = start_trainer(tiny_task, path, *LORA, "trainer.total_training_steps=4", "trainer.n_gpus_per_node=1",
                         "ray_init.num_cpus=1", env=env)
    with killed_on_exit(proc):
        _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == EXIT_WORKER_FAILED, stderr[-3000:]
    reason = last_line(stderr)
    assert "weight sync check failed" in reason, stderr[-3000:]
    assert "the rollout is sampling from the base model, the trained adapter did not reach it" in reason
