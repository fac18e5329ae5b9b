"""No hang by construction, on a (dp=2, sp=2) mesh of 4 CPU processes.

DP rank 0 gets eight long samples, DP rank 1 two short ones (then none at all): the micro-batch
counts differ, the short rank pads with zero-weight dummy micro-batches, everybody finishes (a hang
is a failure after the timeout, the children are killed) and the gradient still equals the
single-process reference of the union. The same launch checks Ulysses inference: log-probs, entropies
and critic values in input order equal the sp=1 / single-process values, and a critic update's gradient equals the reference.
An explicit central plan runs as given (gradient, order restoration), and a malformed one (missing or
duplicate row, wrong rank count, unequal counts, over the budget on one rank only) raises a clear
error on every rank, after which the ranks still run collectives together.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import transformers

from ballast.engine import EngineConfig, GlobalNorm, MicroBatchSpec, MiniBatchPlan, TrainEngine, agg_loss
from ballast.engine.forward import ForwardOptions, forward_micro_batch
from ballast.engine.model import load_model
from testkit.engine import make_rl_batch, reference_log_probs, spawn_ranks
from testkit.models import build_tiny_causal_lm

# Progress bars start tqdm's monitor thread; without it the ranks can be forked (fast).
transformers.utils.logging.disable_progress_bar()

TEMPERATURE = 0.7
LONG = ([30, 12, 55, 8, 20, 41, 5, 17], [80, 100, 60, 110, 90, 70, 112, 95])
SHORT = ([2, 3], [1, 3])
REL_TOL = 1e-5


def token_mean_loss(outputs, micro, norm):
    loss_mat = -micro["advantages"] * outputs["log_probs"]
    return agg_loss(loss_mat, micro["response_mask"], "token-mean", norm), {}


def value_loss(outputs, micro, norm):
    err = outputs["values"] - micro["advantages"]
    return agg_loss(0.5 * err**2, micro["response_mask"], "token-mean", norm), {}


def _batches():
    """(rank-0 data, rank-1 data), both padded to the same widths."""
    prompts, responses = LONG[0] + SHORT[0], LONG[1] + SHORT[1]
    full = make_rl_batch(prompts, responses, vocab_size=128, seed=21)
    return full[:8], full[8:]


def _grads_of_token_mean(model_dir, data):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    lp, _ = reference_log_probs(model, data, 1.0)
    mask = data["response_mask"].float()
    loss = (-(data["advantages"] * lp) * mask).sum() / mask.sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    root = tmp_path_factory.mktemp("uneven")
    model_dir = build_tiny_causal_lm(str(root / "model"), seed=3)
    long, short = _batches()
    both = torch.cat([long, short])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        lp, ent = reference_log_probs(model, both, TEMPERATURE)
        critic = load_model(model_dir, "critic")
        values = forward_micro_batch(critic, both, ForwardOptions(is_critic=True, use_remove_padding=False))["values"]
    critic = load_model(model_dir, "critic")
    out = forward_micro_batch(critic, both, ForwardOptions(is_critic=True, use_remove_padding=False))
    value_ref_loss, _ = value_loss(out, both, GlobalNorm.local(both["response_mask"]))
    value_ref_loss.backward()
    refs = {
        "critic": (float(value_ref_loss.detach()), {n: p.grad.clone() for n, p in critic.named_parameters()}),
        "union": _grads_of_token_mean(model_dir, both),
        "long_only": _grads_of_token_mean(model_dir, long),
        "log_probs": lp, "entropy": ent, "values": values,
    }
    torch.save({"long": long.to_dict(), "short": short.to_dict()}, root / "data.pt")
    torch.save(refs, root / "ref.pt")
    return str(root), model_dir


def _max_rel_grad_diff(engine, ref_grads):
    grads = {n: p.grad.full_tensor() for n, p in engine.model.named_parameters()}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values()))
    return max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads) / float(norm)


def _plan(ranks, budget=512):  # 512 tokens: max_token_len_per_gpu=256 with sp=2
    return MiniBatchPlan(tuple(tuple(np.asarray(mb, dtype=np.int64) for mb in rank) for rank in ranks), budget)


GOOD_PLAN = _plan([[[6, 1, 3, 0], [2, 4, 5, 7]], [[1], [0]]])
BAD_PLANS = {
    # only the rank holding the defect can see it: its peers learn of it through the preflight agreement
    "duplicate": (_plan([[[6, 1, 3, 0], [2, 4, 5, 7]], [[1], [1]]]), "2 rows exactly once|another DP rank"),
    "missing": (_plan([[[6, 1, 3], [2, 4, 5, 7]], [[1], [0]]]), "8 rows exactly once|another DP rank"),
    "rank_count": (_plan([[[0, 1, 2, 3, 4, 5, 6, 7]], [[0, 1]], [[0]]]), "3 ranks, the DP group has 2"),
    "unequal": (_plan([[[6, 1, 3, 0], [2, 4, 5, 7]], [[0, 1]]]), r"unequal micro-batch counts per rank \[1, 2\]"),
    "over_budget": (_plan([[[0, 1, 2, 3, 4, 5, 6], [7]], [[1], [0]]]), "over the budget 512|another DP rank"),
}


def _explicit_plans(engine, mine, dp_rank, refs, report):
    metrics = engine.forward_backward_batch(mine, token_mean_loss, GOOD_PLAN)
    report["explicit/loss"] = (metrics["loss"], refs["union"][0])
    report["explicit/grad"] = _max_rel_grad_diff(engine, refs["union"][1])
    report["explicit/counts"] = (metrics["num_micro_batches"], metrics["num_dummy_micro_batches"])
    engine.zero_grad()
    out = engine.infer_batch(mine, GOOD_PLAN, temperature=TEMPERATURE, calculate_entropy=True)
    rows = slice(0, 8) if dp_rank == 0 else slice(8, 10)
    report["infer_explicit/log_probs"] = float((out["log_probs"] - refs["log_probs"][rows]).abs().max())
    for name, (plan, _) in BAD_PLANS.items():
        try:
            engine.forward_backward_batch(mine, token_mean_loss, plan)
            report[f"bad/{name}"] = "no error"
        except ValueError as exc:
            report[f"bad/{name}"] = str(exc)
        engine.zero_grad()


def _uneven_worker(rank, world, root, model_dir):
    from tensordict import TensorDict

    from ballast.engine.dist import build_parallel_state

    raw = torch.load(os.path.join(root, "data.pt"), weights_only=True)
    refs = torch.load(os.path.join(root, "ref.pt"), weights_only=True)
    long = TensorDict(raw["long"], batch_size=[8])
    short = TensorDict(raw["short"], batch_size=[2])
    parallel = build_parallel_state(2, "cpu")
    mine = long if parallel.dp_rank == 0 else short
    engine = TrainEngine(EngineConfig(model_path=model_dir, ulysses_sequence_parallel_size=2), parallel=parallel)
    report = {}
    specs = {
        "dynamic": MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=64),
        "static-1": MicroBatchSpec(micro_batch_size_per_gpu=1),
    }
    for name, spec in specs.items():
        metrics = engine.forward_backward_batch(mine, token_mean_loss, engine.plan_micro_batches(mine, spec))
        report[f"{name}/loss"] = (metrics["loss"], refs["union"][0])
        report[f"{name}/grad"] = _max_rel_grad_diff(engine, refs["union"][1])
        report[f"{name}/num_dummy"] = metrics["num_dummy_micro_batches"]
        report[f"{name}/micro_tokens"] = engine.last_micro_batch_tokens
        engine.zero_grad()
    # a DP rank with no samples at all
    empty = short[:0]
    lone = long if parallel.dp_rank == 0 else empty
    metrics = engine.forward_backward_batch(lone, token_mean_loss, engine.plan_micro_batches(lone, specs["dynamic"]))
    report["empty/loss"] = (metrics["loss"], refs["long_only"][0])
    report["empty/grad"] = _max_rel_grad_diff(engine, refs["long_only"][1])
    engine.zero_grad()

    _explicit_plans(engine, mine, parallel.dp_rank, refs, report)

    # Ulysses inference, dynamic micro-batches (reordered), restored to input order
    out = engine.infer_batch(mine, engine.plan_micro_batches(mine, specs["dynamic"]), temperature=TEMPERATURE,
                             calculate_entropy=True)
    rows = slice(0, 8) if parallel.dp_rank == 0 else slice(8, 10)
    report["infer/log_probs"] = float((out["log_probs"] - refs["log_probs"][rows]).abs().max())
    report["infer/entropy"] = float((out["entropy"] - refs["entropy"][rows]).abs().max())
    critic = TrainEngine(
        EngineConfig(model_path=model_dir, role="critic", ulysses_sequence_parallel_size=2), parallel=parallel
    )
    values = critic.infer_batch(mine, critic.plan_micro_batches(mine, specs["dynamic"]))["values"]
    report["infer/values"] = float((values - refs["values"][rows]).abs().max())
    metrics = critic.forward_backward_batch(mine, value_loss, critic.plan_micro_batches(mine, specs["dynamic"]))
    report["critic/loss"] = (metrics["loss"], refs["critic"][0])
    report["critic/grad"] = _max_rel_grad_diff(critic, refs["critic"][1])
    empty_out = critic.infer_batch(lone, critic.plan_micro_batches(lone, specs["static-1"]))
    report["infer/empty_rows"] = empty_out.batch_size[0]
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        torch.save(gathered, os.path.join(root, "report.pt"))


def test_uneven_dp_ranks_finish_and_keep_the_gradient_and_ulysses_outputs_exact(problem):
    root, model_dir = problem
    spawn_ranks(_uneven_worker, 4, args=(root, model_dir), timeout_s=180)
    reports = torch.load(os.path.join(root, "report.pt"), weights_only=True)
    failures = []
    for rank, rep in enumerate(reports):
        for key in ("dynamic", "static-1", "empty", "critic"):
            loss, ref = rep[f"{key}/loss"]
            if abs(loss - ref) > REL_TOL * max(1.0, abs(ref)):
                failures.append(f"rank {rank} {key}: loss {loss} != reference {ref}")
            if rep[f"{key}/grad"] > REL_TOL:
                failures.append(f"rank {rank} {key}: max grad diff / ||ref grad|| = {rep[f'{key}/grad']:.3g}")
        for key in ("log_probs", "entropy", "values"):
            if rep[f"infer/{key}"] > 2e-5:
                failures.append(f"rank {rank} Ulysses {key} differ from reference by {rep[f'infer/{key}']:.3g}")
    assert not failures, "\n".join(failures)
    import re

    for rank, rep in enumerate(reports):
        loss, ref = rep["explicit/loss"]
        assert abs(loss - ref) <= REL_TOL * max(1.0, abs(ref)) and rep["explicit/grad"] <= REL_TOL, rank
        assert rep["explicit/counts"] == (2.0, 0.0)
        assert rep["infer_explicit/log_probs"] <= 2e-5
        for name, (_, pattern) in BAD_PLANS.items():
            assert re.search(pattern, rep[f"bad/{name}"]), (rank, name, rep[f"bad/{name}"])
    assert "over the budget 512" in reports[0]["bad/over_budget"]
    assert "another DP rank" in reports[2]["bad/over_budget"]
    # ranks 0, 1 (dp 0, long samples) need several micro-batches; ranks 2, 3 (dp 1) fill with dummies
    assert reports[0]["dynamic/num_dummy"] == reports[1]["dynamic/num_dummy"] == 0
    assert reports[2]["dynamic/num_dummy"] > 0 and reports[2]["dynamic/num_dummy"] == reports[3]["dynamic/num_dummy"]
    assert reports[2]["static-1/num_dummy"] == 6
    # Every DP rank's real tokens per micro-batch, the same lists on every rank (dummies hold none).
    per_dp = [sum(LONG[0]) + sum(LONG[1]), sum(SHORT[0]) + sum(SHORT[1])]
    for spec in ("dynamic", "static-1"):
        tokens = reports[0][f"{spec}/micro_tokens"]
        assert all(r[f"{spec}/micro_tokens"] == tokens for r in reports)
        assert [sum(t) for t in tokens] == per_dp
    assert reports[0]["static-1/micro_tokens"][1] == [SHORT[0][0] + SHORT[1][0], SHORT[0][1] + SHORT[1][1]]
    assert [r["infer/empty_rows"] for r in reports] == [8, 8, 0, 0]


def _hanging_worker(rank, world):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: a collective mismatch
    else:
        time.sleep(120)


def test_a_hang_fails_within_the_timeout_and_kills_the_ranks():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="still running after 5 s"):
        spawn_ranks(_hanging_worker, 2, timeout_s=5)
    assert time.monotonic() - start < 60
