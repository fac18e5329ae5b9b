"""The on-policy shortcut's loss wrapper: same loss and gradient as a separate old-log-prob pass, and
the metrics that pass used to produce."""

import functools

import pytest
import torch
from tensordict import TensorDict

from ballast.engine.losses import GlobalNorm
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, actor_loss
from ballast.workers.on_policy import OnPolicyLoss, is_on_policy, on_policy_train_spec
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
                        "rollout_log_probs": -torch.rand(B, R, generator=gen)}, batch_size=[B])
    return weight, inputs, labels, micro


def _outputs(weight, inputs, labels):
    logp_all = torch.log_softmax(inputs @ weight, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return {"log_probs": logp_all.gather(-1, labels[..., None])[..., 0], "entropy": entropy}


def test_shortcut_matches_a_separate_old_log_prob_pass_and_reports_the_pass_metrics():
    weight, inputs, labels, micro = _problem()
    mask = micro["response_mask"]
    norm = GlobalNorm.local(mask)
    loss_fn = functools.partial(actor_loss, cfg=ActorLossConfig())

    # reference: old log-probs from their own (no-grad) forward, as the separate pass computes them
    with torch.no_grad():
        old = _outputs(weight, inputs, labels)["log_probs"]
    with_old = micro.copy()
    with_old.set("old_log_probs", old)
    ref_loss, ref_metrics = loss_fn(_outputs(weight, inputs, labels), with_old, norm)
    ref_grad, = torch.autograd.grad(ref_loss, weight)

    wrapper = OnPolicyLoss(loss_fn)
    outputs = _outputs(weight, inputs, labels)
    loss, metrics = wrapper(outputs, micro, norm)
    grad, = torch.autograd.grad(loss, weight)

    assert "old_log_probs" not in micro.keys()  # the caller's micro-batch is not modified
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)
    assert float(metrics["actor/ppo_kl"]) == 0.0 and float(metrics["actor/pg_clipfrac"]) == 0.0
    # entropy: token mean over the mini-batch (a share of it: here the whole mini-batch)
    expected_entropy = (outputs["entropy"].detach() * mask).sum() / mask.sum()
    assert float(metrics["actor/entropy"]) == pytest.approx(float(expected_entropy), rel=1e-6)
    diff = (micro["rollout_log_probs"] - outputs["log_probs"].detach()).abs()
    assert float(metrics["training/rollout_actor_log_prob_diff/mean"]) == pytest.approx(
        float((diff * mask).sum() / mask.sum()), rel=1e-6)
    assert wrapper.diff_max(group=None) == pytest.approx(float(diff[mask.bool()].max()), rel=1e-6)


def test_shortcut_max_runs_over_micro_batches_and_metric_shares_add_up():
    weight, inputs, labels, micro = _problem(seed=1)
    norm = GlobalNorm.local(micro["response_mask"])  # the mini-batch normaliser, shared by both halves
    wrapper = OnPolicyLoss(functools.partial(actor_loss, cfg=ActorLossConfig()))
    halves = [slice(0, 2), slice(2, 4)]
    parts = [wrapper(_outputs(weight, inputs[h], labels[h]), micro[h], norm)[1] for h in halves]
    whole = OnPolicyLoss(functools.partial(actor_loss, cfg=ActorLossConfig()))
    _, full = whole(_outputs(weight, inputs, labels), micro, norm)
    for key in ("actor/entropy", "training/rollout_actor_log_prob_diff/mean"):
        assert float(parts[0][key] + parts[1][key]) == pytest.approx(float(full[key]), rel=1e-6), key
    assert wrapper.diff_max(None) == pytest.approx(whole.diff_max(None), rel=1e-7)


def test_shortcut_only_when_one_mini_batch_and_one_epoch():
    assert is_on_policy(1, 1, use_kl_in_reward=False)
    assert not is_on_policy(2, 1, use_kl_in_reward=False)
    assert not is_on_policy(1, 2, use_kl_in_reward=False)
    assert not is_on_policy(1, 1, use_kl_in_reward=True)  # the reward KL needs old log-probs first
    spec = TrainLoopSpec(mini_batch_samples_per_rank=8, ppo_epochs=1, shuffle=False, seed=0,
                         micro=MicroBatchSpec(micro_batch_size_per_gpu=4), loss_fn=lambda *a: None)
    wrapped, wrapper = on_policy_train_spec(spec, num_samples=8)
    assert wrapped.calculate_entropy and wrapped.loss_fn is wrapper and wrapper.loss_fn is spec.loss_fn
    with pytest.raises(ValueError, match="2 mini-batches x 1 epochs"):
        on_policy_train_spec(spec, num_samples=16)
