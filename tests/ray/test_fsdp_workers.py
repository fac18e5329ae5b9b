"""The actor worker through the controller equals the engine run directly (2 DP workers vs 1 process),
with each rank planning its micro-batches and then with the driver's central plan."""

import functools

import numpy as np
import pytest
import torch

from ballast.engine import EngineConfig, MicroBatchSpec, OptimConfig, TrainEngine
from testkit.engine import make_rl_batch
from ballast.protocol import Batch
from ballast.single_controller import RayWorkerGroup, ResourcePool
from ballast.trainer.step_plans import plan_update
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, actor_loss
from ballast.workers.actor_rollout_ref import ActorRolloutRefWorker, engine_input
from ballast.workers.spec import ActorRolloutRefSpec, TrainLoopSpec
from ballast.workers.train_loop import MINI_BATCH_PLANS_KEY, run_train_loop

PROMPTS = [5, 9, 3, 12, 7, 4, 10, 6]
RESPONSES = [20, 3, 40, 8, 15, 31, 2, 11]


@pytest.fixture(scope="module")
def model_dir():
    from ballast.models import tiny_model_dir

    return str(tiny_model_dir())


def _batch(model_dir):
    import json
    import os

    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    td = make_rl_batch(PROMPTS, RESPONSES, vocab_size=vocab, seed=3)
    g = torch.Generator().manual_seed(1)
    td["old_log_probs"] = -torch.rand(td["responses"].shape, generator=g) * 3
    return Batch(td, non_tensors={"uid": np.array([f"u{i // 2}" for i in range(len(PROMPTS))], dtype=object)})


def _spec(model_dir, mini_per_rank):
    engine = EngineConfig(model_path=model_dir, role="actor", device="cpu", use_remove_padding=True,
                          optim=OptimConfig(lr=1e-3))
    loss = functools.partial(actor_loss, cfg=ActorLossConfig())
    train = TrainLoopSpec(mini_batch_samples_per_rank=mini_per_rank, ppo_epochs=1, shuffle=False, seed=0,
                          micro=MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=64), loss_fn=loss)
    infer = MicroBatchSpec(use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    return ActorRolloutRefSpec(actor=engine, actor_train=train, actor_infer=infer, rollout=None,
                               rollout_val_sampling=None, ref=None, ref_infer=None)


def test_two_worker_actor_matches_the_engine_run_directly(ray_session, model_dir):
    batch = _batch(model_dir)
    pool = ResourcePool([2], use_gpu=False, name="actor2")
    group = RayWorkerGroup(pool, ActorRolloutRefWorker, init_args=(_spec(model_dir, 4),), name="actor", timeout_s=600)
    try:
        group.init_model()
        old = group.compute_log_prob(batch)
        batch["advantages"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(2)) \
            * batch["response_mask"]
        remote_metrics = group.update_actor(batch)[0].metrics
        # second update: the driver's central plan (which rank runs what, in which micro-batches)
        plan = plan_update(batch["attention_mask"].sum(-1).numpy(), 2, 8, 64, 1, shuffle=False, seed=0)
        planned = batch[plan.rows]
        planned.meta[MINI_BATCH_PLANS_KEY] = plan.plans
        central_metrics = group.update_actor(planned)[0].metrics
        remote_fingerprint = group.actor_state_fingerprint()
    finally:
        group.kill()
        pool.remove()

    spec = _spec(model_dir, 8)  # one process holding the whole mini-batch
    engine = TrainEngine(spec.actor)
    direct = engine.infer_batch(engine_input(batch), spec.actor_infer, calculate_entropy=True)
    torch.testing.assert_close(old["old_log_probs"], direct["log_probs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(old["entropy"], direct["entropy"], rtol=1e-5, atol=1e-5)
    local = run_train_loop(engine, engine_input(batch, ("old_log_probs", "advantages")), spec.actor_train, 0, "actor").metrics
    local_second = run_train_loop(engine, engine_input(batch, ("old_log_probs", "advantages")), spec.actor_train, 0,
                                  "actor").metrics
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert remote_metrics[key] == pytest.approx(local[key], rel=1e-4, abs=1e-6), key
        assert central_metrics[key] == pytest.approx(local_second[key], rel=1e-4, abs=1e-6), key
    assert central_metrics["actor/num_dummy_micro_batches"] == 0
    fingerprint = sum(float(t.float().abs().sum()) for _, t in engine.iter_full_state_dict())
    assert remote_fingerprint[0] == remote_fingerprint[1] == pytest.approx(fingerprint, rel=1e-6)
    assert remote_metrics["actor/grad_norm"] > 0
