"""Old log-probs from the update's own forward: the first mini-batch's loss wrapper gives the same loss
and gradient as a separate old-log-prob pass and returns its rows' log-probs and entropies in row
order over the plan's micro-batches; the mode rules."""

import functools

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from ballast.engine.losses import GlobalNorm
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, actor_loss
from ballast.workers.on_policy import OldLogProbMode, SelfOldLogProbLoss, old_log_prob_mode

B, R, V = 4, 6, 11


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, V, generator=gen, requires_grad=True)
    inputs = torch.randn(B, R, V, generator=gen)
    labels = torch.randint(0, V, (B, R), generator=gen)
    mask = torch.ones(B, R)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    micro = TensorDict({"response_mask": mask, "advantages": torch.randn(B, R, generator=gen)}, batch_size=[B])
    return weight, inputs, labels, micro


def _outputs(weight, inputs, labels):
    logp_all = torch.log_softmax(inputs @ weight, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return {"log_probs": logp_all.gather(-1, labels[..., None])[..., 0], "entropy": entropy}


def test_own_log_probs_give_the_loss_and_gradient_of_a_separate_pass():
    weight, inputs, labels, micro = _problem()
    norm = GlobalNorm.local(micro["response_mask"])
    loss_fn = functools.partial(actor_loss, cfg=ActorLossConfig())

    # reference: old log-probs of every row from their own (no-grad) forward, as the separate pass
    with torch.no_grad():
        old = _outputs(weight, inputs, labels)["log_probs"]
    with_old = micro.copy()
    with_old.set("old_log_probs", old)
    ref_loss, ref_metrics = loss_fn(_outputs(weight, inputs, labels), with_old, norm)
    ref_grad, = torch.autograd.grad(ref_loss, weight)

    wrapper = SelfOldLogProbLoss(loss_fn)
    outputs = _outputs(weight, inputs, labels)
    loss, metrics = wrapper(outputs, micro, norm)  # the batch carries no old log-probs at all
    grad, = torch.autograd.grad(loss, weight)
    assert "old_log_probs" not in micro.keys()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)
    for key in ("actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_loss"):
        assert float(metrics[key]) == pytest.approx(float(ref_metrics[key]), abs=1e-7), key


def test_collect_puts_rows_back_in_order_over_the_plans_micro_batches():
    weight, inputs, labels, micro = _problem(seed=1)
    norm = GlobalNorm.local(micro["response_mask"])
    wrapper = SelfOldLogProbLoss(functools.partial(actor_loss, cfg=ActorLossConfig()))
    plan = (np.array([3, 0]), np.zeros(0, dtype=np.int64), np.array([2, 1]))  # with a zero-weight step
    for rows in plan:
        if len(rows):
            index = torch.as_tensor(rows)
            wrapper(_outputs(weight, inputs[index], labels[index]), micro[index], norm)
    log_probs, entropy = wrapper.collect(plan)
    whole = _outputs(weight, inputs, labels)
    torch.testing.assert_close(log_probs, whole["log_probs"].detach())
    torch.testing.assert_close(entropy, whole["entropy"].detach())
    with pytest.raises(AssertionError, match="the loss saw 2 micro-batches, the plan has 1"):
        wrapper.collect(plan[:1])


def test_modes():
    assert old_log_prob_mode(1, 1, use_kl_in_reward=False, enabled=True) is OldLogProbMode.UPDATE
    assert old_log_prob_mode(4, 1, use_kl_in_reward=False, enabled=True) is OldLogProbMode.PARTIAL
    assert old_log_prob_mode(4, 1, use_kl_in_reward=False, enabled=False) is OldLogProbMode.PASS  # as verl
    assert old_log_prob_mode(1, 2, use_kl_in_reward=False, enabled=True) is OldLogProbMode.PASS  # epoch 2 differs
    assert old_log_prob_mode(1, 1, use_kl_in_reward=True, enabled=True) is OldLogProbMode.PASS  # reward KL first
    assert OldLogProbMode.PARTIAL.from_update and not OldLogProbMode.PASS.from_update
