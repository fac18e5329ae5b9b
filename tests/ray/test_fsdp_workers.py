"""The actor worker through the controller equals the engine run directly (2 DP workers vs 1 process),
under a contiguous plan of two mini-batches and under the balanced plan of one."""

import functools

import numpy as np
import pytest
import torch

from ballast.balance import MicroBatchMode, MicroBatchPolicy, plan_phase
from ballast.engine import EngineConfig, OptimConfig, TrainEngine
from testkit.engine import make_rl_batch
from ballast.protocol import Batch
from ballast.single_controller import RayWorkerGroup, ResourcePool
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, actor_loss
from ballast.workers.actor_rollout_ref import TrainerWorker, engine_input
from ballast.workers.spec import ActorRolloutRefSpec, TrainLoopSpec
from ballast.workers.train_loop import run_train_loop

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


DYNAMIC = MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=64)
STATIC = MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=2)


def _spec(model_dir):
    engine = EngineConfig(model_path=model_dir, role="actor", device="cpu", use_remove_padding=True,
                          optim=OptimConfig(lr=1e-3))
    loss = functools.partial(actor_loss, cfg=ActorLossConfig())
    return ActorRolloutRefSpec(actor=engine, actor_train=TrainLoopSpec(loss_fn=loss), rollout=None,
                               rollout_val_sampling=None, ref=None)


def test_two_worker_actor_matches_the_engine_run_directly(ray_session, model_dir):
    batch = _batch(model_dir)
    pool = ResourcePool([2], use_gpu=False, name="actor2")
    group = RayWorkerGroup(pool, TrainerWorker, init_args=(_spec(model_dir),), name="actor", timeout_s=600)
    lengths = batch["attention_mask"].sum(-1).numpy()
    try:
        group.init_model()
        infer = plan_phase(lengths, 2, STATIC, balance=False)  # rows stay in place, two per micro-batch
        old = group.compute_log_prob(batch[infer.rows], infer).batch
        batch["advantages"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(2)) \
            * batch["response_mask"]
        # two updates: mini-batches of 4 on the contiguous split, then the balanced plan of one mini-batch
        contiguous = plan_phase(lengths, 2, DYNAMIC, mini_batch_samples=4, balance=False)
        remote_metrics = group.update_actor(batch[contiguous.rows], contiguous)[0].metrics
        balanced = plan_phase(lengths, 2, DYNAMIC)
        central_metrics = group.update_actor(batch[balanced.rows], balanced)[0].metrics
        remote_fingerprint = group.actor_state_fingerprint()
    finally:
        group.kill()
        pool.remove()

    spec = _spec(model_dir)  # one process holding every row
    engine = TrainEngine(spec.actor)
    direct = engine.infer_batch(engine_input(batch), plan_phase(lengths, 1, STATIC).mini_batches[0],
                                calculate_entropy=True)
    torch.testing.assert_close(old["old_log_probs"], direct["log_probs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(old["entropy"], direct["entropy"], rtol=1e-5, atol=1e-5)
    data = engine_input(batch, ("old_log_probs", "advantages"))
    # the same mini-batches as the remote runs: rows 0-3 then 4-7, then all rows at once
    first = plan_phase(lengths, 1, DYNAMIC, mini_batch_samples=4, balance=False)
    local = run_train_loop(engine, data[torch.as_tensor(first.rows)], first, spec.actor_train, "actor").metrics
    whole = plan_phase(lengths, 1, DYNAMIC)
    local_second = run_train_loop(engine, data[torch.as_tensor(whole.rows)], whole, spec.actor_train, "actor").metrics
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert remote_metrics[key] == pytest.approx(local[key], rel=1e-4, abs=1e-6), key
        assert central_metrics[key] == pytest.approx(local_second[key], rel=1e-4, abs=1e-6), key
    assert central_metrics["actor/num_dummy_micro_batches"] == 0
    fingerprint = sum(float(t.float().abs().sum()) for _, t in engine.iter_full_state_dict())
    assert remote_fingerprint[0] == remote_fingerprint[1] == pytest.approx(fingerprint, rel=1e-6)
    assert remote_metrics["actor/grad_norm"] > 0
