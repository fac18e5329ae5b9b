"""Per-step rules checked against verl's: loss metrics are additive shares, critic warmup, and the
in-reward KL coefficient that is logged."""

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from ballast.engine.losses import LOSS_AGG_MODES, GlobalNorm
from ballast.trainer.algorithms import make_kl_controller
from ballast.trainer.algorithms.kl import kl_penalty
from ballast.trainer.algorithms.policy_loss import (
    ActorLossConfig, CriticLossConfig, actor_constant_metrics, actor_loss, critic_loss,
)
from ballast.trainer.ray_trainer import actor_updates_at, apply_kl_in_reward


def _micro(batch=6, width=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, width, generator=gen) < 0.7).float()
    mask[:, 0] = 1.0
    micro = TensorDict({
        "response_mask": mask, "old_log_probs": -torch.rand(batch, width, generator=gen),
        "advantages": torch.randn(batch, width, generator=gen), "ref_log_prob": -torch.rand(batch, width, generator=gen),
        "values": torch.randn(batch, width, generator=gen), "returns": torch.randn(batch, width, generator=gen),
    }, batch_size=[batch])
    outputs = {"log_probs": -torch.rand(batch, width, generator=gen), "entropy": torch.rand(batch, width, generator=gen),
               "values": torch.randn(batch, width, generator=gen)}
    return micro, outputs


def _summed_over_cut(loss_fn, micro, outputs, cuts):
    """What the engine logs: each metric summed over the micro-batches of the mini-batch."""
    norm = GlobalNorm.local(micro["response_mask"])
    total = {}
    for rows in cuts:
        _, metrics = loss_fn({k: v[rows] for k, v in outputs.items()}, micro[rows], norm)
        for key, value in metrics.items():
            total[key] = total.get(key, 0.0) + float(value)
    return total


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_loss_metric_is_independent_of_the_micro_batch_cut(mode):
    micro, outputs = _micro()
    cfg = ActorLossConfig(loss_agg_mode=mode, use_kl_loss=True, kl_loss_coef=0.001, entropy_coeff=0.01)
    whole = _summed_over_cut(lambda o, m, n: actor_loss(o, m, n, cfg=cfg), micro, outputs, [np.arange(6)])
    cut = _summed_over_cut(lambda o, m, n: actor_loss(o, m, n, cfg=cfg), micro, outputs,
                           [np.array([0]), np.array([1, 2]), np.array([3, 4, 5])])
    assert whole.keys() == cut.keys()
    for key in whole:
        assert cut[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    ccfg = CriticLossConfig(loss_agg_mode=mode)
    whole = _summed_over_cut(lambda o, m, n: critic_loss(o, m, n, cfg=ccfg), micro, outputs, [np.arange(6)])
    cut = _summed_over_cut(lambda o, m, n: critic_loss(o, m, n, cfg=ccfg), micro, outputs,
                           [np.array([0, 5]), np.array([1, 2, 3, 4])])
    for key in whole:
        assert cut[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key


def test_kl_coef_is_logged_once_as_configured():
    cfg = ActorLossConfig(use_kl_loss=True, kl_loss_coef=0.001)
    micro, outputs = _micro()
    logged = _summed_over_cut(lambda o, m, n: actor_loss(o, m, n, cfg=cfg), micro, outputs,
                              [np.array([i]) for i in range(6)])
    logged.update(actor_constant_metrics(cfg))
    assert logged["actor/kl_coef"] == 0.001
    assert actor_constant_metrics(ActorLossConfig(use_kl_loss=False)) == {}


def test_critic_warmup_counts_like_verl():
    # verl: `if critic_warmup <= global_steps: update_actor`, global_steps starting at 1.
    assert [actor_updates_at(s, 0) for s in (1, 2)] == [True, True]
    assert [actor_updates_at(s, 1) for s in (1, 2)] == [True, True]
    assert [actor_updates_at(s, 3) for s in (1, 2, 3, 4)] == [False, False, True, True]


def test_logged_reward_kl_coefficient_is_the_one_applied():
    ctrl = make_kl_controller("adaptive", kl_coef=0.2, target_kl=0.01, horizon=10)
    gen = torch.Generator().manual_seed(1)
    scores = torch.zeros(4, 3)
    mask = torch.ones(4, 3)
    kld = kl_penalty(-torch.rand(4, 3, generator=gen), -torch.rand(4, 3, generator=gen), "kl") * mask
    rewards, metrics = apply_kl_in_reward(scores, kld, mask, ctrl)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.2
    torch.testing.assert_close(rewards, -0.2 * kld)
    assert ctrl.value != 0.2  # updated for the next step
