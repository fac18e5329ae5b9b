"""Old log-probs from the actor update itself: the same training as a separate pass over every row.

Two gloo ranks, the tiny Qwen2, a step of 8 samples in 2 mini-batches under the driver's plan, run
through the actor worker's own `update_actor` (without Ray). Run A is verl's order: a separate
inference pass over every row, then the update ("pass"). Run B (fresh engine, same weights) sends no
old log-probs at all: the update computes them itself ("partial": a forward-only pass over the rows
after its first mini-batch, the first mini-batch's own). The parameters after the update, the update
metrics, and the log-probs and entropies B's update hands back (mapped to step rows by the driver's
own function) all equal A's within float rounding.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ballast.balance import MicroBatchMode, MicroBatchPolicy, plan_phase
from ballast.engine import EngineConfig, OptimConfig, TrainEngine
from ballast.protocol import Batch
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, actor_loss
from ballast.trainer.step.old_log_probs import take_from_update
from ballast.trainer.step.plans import plan_after_first_mini_batch
from ballast.workers.actor_rollout_ref import TrainerWorker
from ballast.workers.on_policy import OldLogProbMode
from ballast.workers.spec import TrainLoopSpec
from testkit.engine import make_rl_batch, spawn_ranks

PROMPTS = [5, 9, 3, 12, 7, 4, 10, 6]
RESPONSES = [20, 3, 40, 8, 15, 31, 2, 11]
POLICY = MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=64)


def _worker(model_dir):
    cfg = EngineConfig(model_path=model_dir, role="actor", device="cpu", use_remove_padding=True,
                       optim=OptimConfig(lr=1e-2))
    spec = SimpleNamespace(actor_train=TrainLoopSpec(loss_fn=functools.partial(actor_loss, cfg=ActorLossConfig())),
                           temperature=1.0)
    worker = TrainerWorker(spec)
    worker.actor = TrainEngine(cfg, seed=0)
    worker._peak_flops = None
    return worker


def _mine(batch: Batch, plan, rank: int) -> Batch:
    return batch[plan.rank_rows(rank)]


def _run(rank: int, world: int, model_dir: str) -> None:
    step = Batch(make_rl_batch(PROMPTS, RESPONSES, vocab_size=128, seed=5))
    lengths = step["attention_mask"].sum(-1).numpy()
    plan = plan_phase(lengths, world, POLICY, mini_batch_samples=4)
    assert len(plan.mini_batches) == 2

    # A: a separate pass over every row (its own plan), then the update
    worker_a = _worker(model_dir)
    infer = plan_phase(lengths, world, POLICY)
    passed = worker_a.compute_log_prob(_mine(step, infer, rank), infer).batch
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (passed["old_log_probs"], passed["entropy"]))
    index = torch.as_tensor(infer.restore_index())
    expected = torch.cat([g[0] for g in gathered])[index]
    expected_entropy = torch.cat([g[1] for g in gathered])[index]
    data_a = step[torch.arange(len(step))]
    data_a["old_log_probs"] = expected
    metrics_a = worker_a.update_actor(_mine(data_a, plan, rank), plan, OldLogProbMode.PASS).metrics
    params_a = dict(worker_a.actor.iter_full_state_dict())

    # B: no old log-probs in the batch; the update computes them
    worker_b = _worker(model_dir)
    rest = plan_after_first_mini_batch(lengths, plan, POLICY)
    result_b = worker_b.update_actor(_mine(step, plan, rank), plan, OldLogProbMode.PARTIAL, rest)
    params_b = dict(worker_b.actor.iter_full_state_dict())

    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac", "actor/loss"):
        assert abs(metrics_a[key] - result_b.metrics[key]) <= 1e-5 * max(1.0, abs(metrics_a[key])), key
    assert list(params_a) == list(params_b)
    for name in params_a:
        torch.testing.assert_close(params_b[name], params_a[name], rtol=1e-5, atol=1e-6)
    fresh = dict(_worker(model_dir).actor.iter_full_state_dict())
    assert sum(float((params_a[n] - p).abs().sum()) for n, p in fresh.items()) > 0  # the update moved the weights

    # the driver maps every rank's returned rows back to step rows: they equal pass A's values
    results: list = [None] * world
    dist.all_gather_object(results, result_b)
    filled = step[torch.arange(len(step))]
    take_from_update(filled, results, plan)
    mask = step["response_mask"].bool()
    torch.testing.assert_close(filled["old_log_probs"][mask], expected[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(filled["entropy"][mask], expected_entropy[mask], rtol=1e-5, atol=1e-5)
    dist.barrier()


def test_first_mini_batch_log_probs_from_the_update_train_like_a_separate_pass(tmp_path):
    from testkit.models import build_tiny_causal_lm

    model_dir = build_tiny_causal_lm(str(tmp_path / "model"), seed=2)
    spawn_ranks(_run, 2, args=(model_dir,), timeout_s=300)
