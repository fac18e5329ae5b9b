"""Multi-turn sequences through the batch path: conversations whose responses interleave sampled tokens
(response_mask 1) with inserted tool/user tokens (attention 1, response_mask 0) keep the invariance
guarantee (loss and gradients equal the single-process reference) for every micro-batch cut, remove-
padding on and off, data and Ulysses sequence parallelism; lengths, balancing and token budgets count
the whole conversation; a conversation longer than the budget is a clear error before training."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from ballast.balance import MicroBatchMode, MicroBatchPolicy, plan_phase
from ballast.engine.losses import LOSS_AGG_MODES
from test_invariance_engine import NUM_SAMPLES, REL_TOL, _invariance_worker, _lengths, _reference
from testkit.engine import make_rl_batch, spawn_ranks
from testkit.models import build_tiny_causal_lm


def multi_turn_batch():
    """The invariance test's lengths; every response of >= 6 tokens gets one or two inserted spans."""
    prompts, responses = _lengths()
    data = make_rl_batch(prompts, responses, vocab_size=128, seed=11)
    rng = np.random.default_rng(5)
    for row, r in enumerate(responses):
        spans = 2 if r >= 24 else 1 if r >= 6 else 0
        for k in range(spans):
            start = int(rng.integers(1 + k * r // 2, max(2 + k * r // 2, (k + 1) * r // 2 - 2)))
            width = int(rng.integers(1, max(2, r // 4)))
            data["response_mask"][row, start:start + width] = 0  # "tool tokens": attended, not trained
    return data


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_turn_invariance")
    model_dir = build_tiny_causal_lm(str(root / "model"), seed=7, tie_word_embeddings=True)
    data = multi_turn_batch()
    resp_real = data["attention_mask"][:, -data["responses"].shape[1]:]
    assert int((resp_real - data["response_mask"]).sum()) > 20  # holes exist, inside real responses
    torch.save(data.to_dict(), root / "data.pt")
    torch.save(_reference(model_dir, data), root / "ref.pt")
    return str(root), model_dir


LAYOUTS = [(2, 1), (1, 2)]


@pytest.mark.parametrize("dp, sp", LAYOUTS, ids=lambda v: str(v))
def test_multi_turn_loss_and_gradient_equal_the_reference(problem, dp, sp):
    root, model_dir = problem
    # loss aggregation modes rotated like the invariance test's: a configuration on both layouts runs
    # each cut under two modes here and the other two on the other layout; remove-padding off (sp=1
    # only) runs all four
    spawn_ranks(_invariance_worker, dp * sp, args=(root, model_dir, sp, LAYOUTS, False), timeout_s=300)
    with open(os.path.join(root, f"results_{dp * sp}_{sp}.json")) as f:
        results = json.load(f)
    assert results and {r["mode"] for r in results} == set(LOSS_AGG_MODES)
    failures = [f"{r['spec']} rmpad={r['rmpad']} {r['mode']}: loss {r['loss']:.8g} vs {r['ref_loss']:.8g}, "
                f"grad diff {r['max_grad_diff']:.3g}" for r in results
                if abs(r["loss"] - r["ref_loss"]) > REL_TOL * max(1.0, abs(r["ref_loss"]))
                or r["max_grad_diff"] > REL_TOL * r["ref_grad_norm"]]
    assert not failures, "\n".join(failures)


def test_plans_count_whole_conversations_and_reject_one_over_the_budget():
    data = multi_turn_batch()
    lengths = data["attention_mask"].sum(-1).numpy()
    assert (lengths > data["response_mask"].sum(-1).numpy()).any()  # inserted tokens are counted
    budget = int(lengths.max())
    plan = plan_phase(lengths, 2, MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=budget))
    (mb,) = plan.mini_batches
    for rank in range(2):
        rows = np.asarray(plan.rank_rows(rank))
        for micro in mb.for_rank(rank):  # positions inside the rank's rows
            assert lengths[rows[micro]].sum() <= budget
    assert sorted(np.concatenate([plan.rank_rows(r) for r in range(2)]).tolist()) == list(range(NUM_SAMPLES))
    with pytest.raises(ValueError, match=f"{budget}.*{budget - 1}|{budget - 1}.*{budget}"):
        plan_phase(lengths, 2, MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=budget - 1))
