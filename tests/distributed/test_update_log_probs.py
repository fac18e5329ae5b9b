"""Old log-probs from the update's first mini-batch: same training as a separate pass over every row.

Two gloo ranks, the tiny Qwen2, a step of 8 samples in 2 mini-batches under the driver's central plan.
Run A computes every row's old log-probs with the engine's inference pass and then updates; run B
(fresh engine, same weights) marks the first mini-batch's rows, gives them a garbage placeholder, and
updates with the wrapper. The parameters after the update, the update metrics, and the log-probs and
entropies that B's update hands back (mapped to step rows by the driver's own function) all equal A's
within float rounding.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.distributed as dist

from ballast.engine import EngineConfig, MicroBatchSpec, OptimConfig, TrainEngine
from ballast.protocol import Batch
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, actor_loss
from ballast.trainer.old_log_probs import fill_from_update, first_mini_batch_rows
from ballast.trainer.step_plans import plan_update
from ballast.workers.on_policy import FROM_UPDATE_KEY, ROW_INDEX_KEY, update_log_prob_train_spec
from ballast.workers.spec import TrainLoopSpec
from ballast.workers.train_loop import UpdateResult, run_train_loop
from testkit.engine import make_rl_batch, spawn_ranks

PROMPTS = [5, 9, 3, 12, 7, 4, 10, 6]
RESPONSES = [20, 3, 40, 8, 15, 31, 2, 11]
KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages", "old_log_probs")


def _engine(model_dir):
    cfg = EngineConfig(model_path=model_dir, role="actor", device="cpu", use_remove_padding=True,
                       optim=OptimConfig(lr=1e-2))
    return TrainEngine(cfg, seed=0)


def _run(rank: int, world: int, model_dir: str) -> None:
    step = make_rl_batch(PROMPTS, RESPONSES, vocab_size=128, seed=5)
    step["old_log_probs"] = torch.zeros(step["responses"].shape)
    plan = plan_update(step["attention_mask"].sum(-1).numpy(), world, 4, 64, 1, shuffle=False, seed=0)
    laid_out = step[torch.as_tensor(plan.rows)]
    per_rank = len(plan.rows) // world
    mine = laid_out[rank * per_rank:(rank + 1) * per_rank]
    infer = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=64)
    spec = TrainLoopSpec(mini_batch_samples_per_rank=2, ppo_epochs=1, shuffle=False, seed=0,
                         micro=MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=64),
                         loss_fn=functools.partial(actor_loss, cfg=ActorLossConfig()))

    # A: a separate pass over every row, then the update
    engine_a = _engine(model_dir)
    passed = engine_a.infer_batch(mine.select(*KEYS[:5]), infer, calculate_entropy=True)
    data_a = mine.clone()
    data_a["old_log_probs"] = passed["log_probs"]
    metrics_a = run_train_loop(engine_a, data_a, spec, rank, "actor", plans=plan.plans).metrics
    params_a = dict(engine_a.iter_full_state_dict())

    # B: the first mini-batch's rows marked, a garbage placeholder in their old log-probs
    engine_b = _engine(model_dir)
    marked = np.zeros(len(step), dtype=bool)
    marked[first_mini_batch_rows(plan.rows, world, 2)] = True
    marked_mine = torch.as_tensor(marked[plan.rows[rank * per_rank:(rank + 1) * per_rank]])
    assert marked_mine[:2].all() and not marked_mine[2:].any()  # exactly this rank's first mini-batch
    data_b = mine.clone()
    data_b["old_log_probs"] = torch.where(marked_mine[:, None], torch.full_like(passed["log_probs"], 77.0),
                                          passed["log_probs"])
    data_b[FROM_UPDATE_KEY] = marked_mine
    data_b[ROW_INDEX_KEY] = torch.arange(per_rank)
    wrapped, wrapper = update_log_prob_train_spec(spec)
    result_b = run_train_loop(engine_b, data_b, wrapped, rank, "actor", plans=plan.plans)
    result_b.update_log_probs = wrapper.collect()
    params_b = dict(engine_b.iter_full_state_dict())

    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac", "actor/loss"):
        assert abs(metrics_a[key] - result_b.metrics[key]) <= 1e-5 * max(1.0, abs(metrics_a[key])), key
    assert list(params_a) == list(params_b)
    for name in params_a:
        torch.testing.assert_close(params_b[name], params_a[name], rtol=1e-5, atol=1e-6)
    changed = sum(float((params_a[n] - p).abs().sum()) for n, p in dict(_engine(model_dir).iter_full_state_dict()).items())
    assert changed > 0  # the update did move the weights

    # the driver maps every rank's returned rows back to step rows: they equal pass A's values
    results: list = [None] * world
    dist.all_gather_object(results, UpdateResult({}, [], result_b.update_log_probs))
    expected = torch.zeros(step["responses"].shape)
    expected_entropy = torch.zeros(step["responses"].shape)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (passed["log_probs"], passed["entropy"]))
    for r, (lp, ent) in enumerate(gathered):
        rows = torch.as_tensor(plan.rows[r * per_rank:(r + 1) * per_rank])
        expected[rows], expected_entropy[rows] = lp, ent
    filled = Batch(step.clone())
    filled["old_log_probs"] = torch.zeros(step["responses"].shape)
    entropy = torch.zeros(step["responses"].shape)
    assert fill_from_update(filled, entropy, results, plan.rows) == int(marked.sum())
    rows = torch.as_tensor(np.flatnonzero(marked))
    mask = step["response_mask"][rows].bool()
    torch.testing.assert_close(filled["old_log_probs"][rows][mask], expected[rows][mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[rows][mask], expected_entropy[rows][mask], rtol=1e-5, atol=1e-5)
    unmarked = torch.as_tensor(np.flatnonzero(~marked))
    assert float(filled["old_log_probs"][unmarked].abs().sum()) == 0.0  # only the marked rows were written
    dist.barrier()


def test_first_mini_batch_log_probs_from_the_update_train_like_a_separate_pass(tmp_path):
    from testkit.models import build_tiny_causal_lm

    model_dir = build_tiny_causal_lm(str(tmp_path / "model"), seed=2)
    spawn_ranks(_run, 2, args=(model_dir,), timeout_s=300)
