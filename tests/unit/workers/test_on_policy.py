"""Old log-probs from the update's own forward: the loss wrapper gives the same loss and gradient as a
separate old-log-prob pass, touches only the marked rows and returns their log-probs and entropies;
the mode rules and the marked-row check."""

import functools

import pytest
import torch
from tensordict import TensorDict

from ballast.engine.losses import GlobalNorm
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, actor_loss
from ballast.workers.on_policy import (
    FROM_UPDATE_KEY, ROW_INDEX_KEY, UpdateLogProbLoss, check_marked_rows, first_mini_batch_mode,
    update_log_prob_train_spec,
)
from ballast.workers.spec import TrainLoopSpec
from ballast.engine import MicroBatchSpec

B, R, V = 4, 6, 11


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, V, generator=gen, requires_grad=True)
    inputs = torch.randn(B, R, V, generator=gen)
    labels = torch.randint(0, V, (B, R), generator=gen)
    mask = torch.ones(B, R)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    micro = TensorDict({"response_mask": mask, "advantages": torch.randn(B, R, generator=gen),
                        ROW_INDEX_KEY: torch.tensor([7, 2, 5, 0])}, batch_size=[B])
    return weight, inputs, labels, micro


def _outputs(weight, inputs, labels):
    logp_all = torch.log_softmax(inputs @ weight, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return {"log_probs": logp_all.gather(-1, labels[..., None])[..., 0], "entropy": entropy}


@pytest.mark.parametrize("marked", [[True, True, True, True], [True, False, True, False], [False] * 4])
def test_marked_rows_get_their_own_log_probs_and_the_loss_equals_a_separate_pass(marked):
    weight, inputs, labels, micro = _problem()
    norm = GlobalNorm.local(micro["response_mask"])
    loss_fn = functools.partial(actor_loss, cfg=ActorLossConfig())
    marked = torch.tensor(marked)

    # reference: old log-probs of every row from their own (no-grad) forward, as the separate pass
    with torch.no_grad():
        old = _outputs(weight, inputs, labels)["log_probs"]
    with_old = micro.copy()
    with_old.set("old_log_probs", old)
    ref_loss, ref_metrics = loss_fn(_outputs(weight, inputs, labels), with_old, norm)
    ref_grad, = torch.autograd.grad(ref_loss, weight)

    # marked rows carry a placeholder (garbage here: it must not leak into the loss)
    given = micro.copy()
    given.set("old_log_probs", torch.where(marked[:, None], torch.full((B, R), -123.0), old))
    given.set(FROM_UPDATE_KEY, marked)
    wrapper = UpdateLogProbLoss(loss_fn)
    outputs = _outputs(weight, inputs, labels)
    loss, metrics = wrapper(outputs, given, norm)
    grad, = torch.autograd.grad(loss, weight)

    assert float(given["old_log_probs"][marked].sum()) == pytest.approx(-123.0 * R * int(marked.sum()))  # not modified
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)
    for key in ("actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_loss"):
        assert float(metrics[key]) == pytest.approx(float(ref_metrics[key]), abs=1e-7), key

    got = wrapper.collect()
    if not marked.any():
        assert got is None
        return
    rows = micro[ROW_INDEX_KEY][marked]
    order = torch.argsort(rows)
    assert got.rows.tolist() == sorted(rows.tolist())
    torch.testing.assert_close(got.old_log_probs, outputs["log_probs"].detach()[marked][order])
    torch.testing.assert_close(got.entropy, outputs["entropy"].detach()[marked][order])


def test_collect_orders_rows_over_micro_batches_and_refuses_a_row_seen_twice():
    weight, inputs, labels, micro = _problem(seed=1)
    micro.set(FROM_UPDATE_KEY, torch.ones(B, dtype=torch.bool))
    micro.set("old_log_probs", torch.zeros(B, R))
    norm = GlobalNorm.local(micro["response_mask"])
    wrapper = UpdateLogProbLoss(functools.partial(actor_loss, cfg=ActorLossConfig()))
    halves = [slice(2, 4), slice(0, 2)]
    for h in halves:
        wrapper(_outputs(weight, inputs[h], labels[h]), micro[h], norm)
    got = wrapper.collect()
    whole = _outputs(weight, inputs, labels)
    order = torch.argsort(micro[ROW_INDEX_KEY])
    assert got.rows.tolist() == [0, 2, 5, 7]
    torch.testing.assert_close(got.old_log_probs, whole["log_probs"].detach()[order])
    wrapper(_outputs(weight, inputs[:1], labels[:1]), micro[:1], norm)  # row 7 again
    with pytest.raises(AssertionError, match="ran twice"):
        wrapper.collect()


def test_modes():
    assert first_mini_batch_mode(1, 1, use_kl_in_reward=False, central_plan=False) == "update"
    assert first_mini_batch_mode(4, 1, use_kl_in_reward=False, central_plan=True) == "partial"
    assert first_mini_batch_mode(4, 1, use_kl_in_reward=False, central_plan=False) == "pass"  # rows unknown
    assert first_mini_batch_mode(1, 2, use_kl_in_reward=False, central_plan=True) == "pass"  # epoch 2 differs
    assert first_mini_batch_mode(1, 1, use_kl_in_reward=True, central_plan=True) == "pass"  # reward KL first


def test_marked_rows_must_be_in_the_first_mini_batch_of_the_first_epoch():
    first = torch.tensor([True, True, False, False])
    check_marked_rows(first, 2, 1, shuffled_per_rank=False)
    check_marked_rows(torch.ones(4, dtype=torch.bool), 4, 1, shuffled_per_rank=True)  # one mini-batch
    check_marked_rows(torch.zeros(4, dtype=torch.bool), 2, 3, shuffled_per_rank=True)  # nothing marked
    with pytest.raises(ValueError, match="2 mini-batches x 1 epochs"):
        check_marked_rows(torch.tensor([True, False, True, False]), 2, 1, shuffled_per_rank=False)
    with pytest.raises(ValueError, match="not all in the first mini-batch"):
        check_marked_rows(first, 2, 1, shuffled_per_rank=True)  # the rank reshuffles: row 0 may come later
    with pytest.raises(ValueError, match="x 2 epochs"):
        check_marked_rows(first, 2, 2, shuffled_per_rank=False)


def test_train_spec_wraps_the_loss_and_turns_entropy_on():
    spec = TrainLoopSpec(mini_batch_samples_per_rank=8, ppo_epochs=1, shuffle=False, seed=0,
                         micro=MicroBatchSpec(micro_batch_size_per_gpu=4), loss_fn=lambda *a: None)
    wrapped, wrapper = update_log_prob_train_spec(spec)
    assert wrapped.calculate_entropy and wrapped.loss_fn is wrapper and wrapper.loss_fn is spec.loss_fn
