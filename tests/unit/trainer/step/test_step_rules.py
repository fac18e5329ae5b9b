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
from ballast.trainer.ray_trainer import actor_updates_at
from ballast.trainer.step.advantage_phase import apply_kl_in_reward


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


def test_timing_throughput_and_rollout_probability_metrics_use_verl_names_and_units():
    from ballast.protocol import Batch
    from ballast.trainer.step.metrics import rollout_probs_diff_metrics, throughput_metrics, timing_metrics

    attention = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    response_mask = attention[:, 2:].clone()
    old = torch.log(torch.tensor([[0.5, 0.25, 1.0], [0.1, 0.2, 0.3]]))
    rollout = torch.log(torch.tensor([[0.4, 0.25, 1.0], [0.1, 0.3, 0.3]]))
    batch = Batch({"attention_mask": attention, "response_mask": response_mask, "responses": torch.zeros(2, 3),
                   "old_log_probs": old, "rollout_log_probs": rollout})
    timing = timing_metrics(batch, {"gen": 0.5, "update_actor": 0.8, "reward": 0.1})
    assert timing["timing_per_token_ms/gen"] == pytest.approx(500 / 5)  # 5 response tokens
    assert timing["timing_per_token_ms/update_actor"] == pytest.approx(800 / 8)  # 8 tokens overall
    assert "timing_per_token_ms/reward" not in timing and timing["timing_s/reward"] == 0.1
    perf = throughput_metrics(batch, step_seconds=2.0, num_workers=4)
    assert perf["perf/throughput"] == pytest.approx(8 / 2 / 4) and perf["perf/time_per_step"] == 2.0
    probs = rollout_probs_diff_metrics(batch)
    diffs = torch.tensor([0.1, 0.0, 0.0, 0.1, 0.0])
    assert probs["training/rollout_probs_diff_max"] == pytest.approx(0.1)
    assert probs["training/rollout_probs_diff_mean"] == pytest.approx(float(diffs.mean()))
    assert probs["training/rollout_probs_diff_std"] == pytest.approx(float(diffs.std()))
    assert -1.0 <= probs["training/rollout_actor_probs_pearson_corr"] <= 1.0
