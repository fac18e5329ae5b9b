"""Rollout correction against verl 0.9.1's own functions (`rollout_corr_helper`, the bypass-mode policy
loss and the `RolloutCorrectionConfig` presets), on seeded float64 fixtures, to 1e-6: weights, masks
and every metric, for every IS level and threshold form, every rejection option alone and chained,
batch normalisation, and both bypass loss types under every loss aggregation mode.

Where verl is not installed the whole module is skipped at collection, like the other parity tests.
"""

import pytest
import torch

from ballast.engine.losses import LOSS_AGG_MODES, GlobalNorm
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, actor_loss, actor_loss_stats
from ballast.trainer.algorithms.rollout_correction import (RS_OPTIONS, correct, normalise, normaliser,
                                                           normaliser_sums, parse_rollout_correction)
from ballast.trainer.algorithms.rollout_correction_metrics import correction_metrics
from ballast.trainer.algorithms.rollout_correction_presets import PRESETS, preset

# Without verl the whole module is skipped here, at collection (a skip, not a collection error).
V = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl 0.9.1 is not installed (bash scripts/setup.sh "
                        "installs it): the verl parity tests need it as their reference")
import verl.trainer.ppo.rollout_corr_helper as H  # noqa: E402
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402

TOL = dict(atol=1e-6, rtol=1e-6)
B, R = 14, 9
KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold",
        "bypass_mode", "loss_type")


def _fixture(seed, spread=0.3):
    """Right-padded responses of 0..R tokens (one row empty), rollout log-probs = train + noise."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (B,), generator=gen)
    lengths[3] = 0
    mask = (torch.arange(R)[None] < lengths[:, None]).double()
    train = -torch.rand(B, R, generator=gen, dtype=torch.float64) * 3
    rollout = train + torch.randn(B, R, generator=gen, dtype=torch.float64) * spread
    rollout[5] = train[5] + 2.5  # one sequence far off: rejected / truncated by most settings
    garbage = torch.randn(B, R, generator=gen, dtype=torch.float64) * 50  # padding must not matter
    return train * mask + garbage * (1 - mask), rollout * mask + garbage * (1 - mask), mask


def _settings():
    """(id, verl keyword settings): every IS form, every RS option, chains, normalisation."""
    out = []
    for level in ("token", "sequence"):
        for threshold in (2.0, "1.5", "0.5_5.0", "0.8_1.25"):
            for norm in (False, True):
                out.append((f"is-{level}-{threshold}-norm{int(norm)}",
                            dict(rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=norm)))
    thresholds = {"k1": "0.7_1.3", "k2": 0.05, "k3": 0.02}
    for option in RS_OPTIONS:
        out.append((f"rs-{option}", dict(rollout_rs=option, rollout_rs_threshold=thresholds[option[-2:]])))
    out.append(("rs-k1-single-number", dict(rollout_rs="seq_sum_k1", rollout_rs_threshold=1.8)))
    out.append(("rs-chain-per-option", dict(rollout_rs="token_k1,seq_mean_k3,seq_max_k2,token_k1",
                                            rollout_rs_threshold="0.6_1.6,0.03,0.4")))
    out.append(("rs-chain-broadcast", dict(rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="2.0")))
    out.append(("is-and-rs", dict(rollout_is="sequence", rollout_is_threshold="0.5_3.0", rollout_is_batch_normalize=True,
                                  rollout_rs="seq_mean_k1,token_k2", rollout_rs_threshold="0.9_1.1,0.1")))
    out.append(("metrics-only", dict()))
    return out


def _verl(train, rollout, mask, settings):
    kwargs = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False, rollout_rs=None,
                  rollout_rs_threshold=None)
    kwargs.update(settings)
    weights, new_mask, metrics = H.compute_rollout_correction_and_rejection_mask(
        old_log_prob=train, rollout_log_prob=rollout, response_mask=mask, **kwargs)
    return None if weights is None else weights.batch["rollout_is_weights"], new_mask, metrics


def _ours(train, rollout, mask, settings):
    corr = parse_rollout_correction(**settings)
    c = correct(train, rollout, mask, corr)
    metrics = correction_metrics(train, rollout, mask, corr, c)
    weights = None
    if c.weights is not None:
        weights = c.weights.weights
        if corr.batch_normalize:
            mean = normaliser(normaliser_sums(weights, mask, corr.rollout_is), corr.rollout_is)
            weights = normalise(weights, mean)
            metrics["rollout_corr/rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
    return weights, c.mask, metrics


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name, settings", _settings(), ids=[n for n, _ in _settings()])
def test_weights_masks_and_metrics_match_verl(name, settings, seed):
    train, rollout, mask = _fixture(seed)
    want_w, want_mask, want_m = _verl(train, rollout, mask, settings)
    got_w, got_mask, got_m = _ours(train, rollout, mask, settings)
    assert (got_w is None) == (want_w is None)
    if want_w is not None:
        torch.testing.assert_close(got_w * mask, want_w * mask, **TOL)
    torch.testing.assert_close(got_mask.double(), want_mask.double(), **TOL)
    assert sorted(got_m) == sorted(want_m)
    for key, value in want_m.items():
        assert got_m[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


def test_the_fixtures_exercise_every_branch():
    """The thresholds above really clip, zero and reject something (else parity would be vacuous)."""
    train, rollout, mask = _fixture(0)
    _, _, m = _ours(train, rollout, mask, dict(rollout_is="token", rollout_is_threshold="0.8_1.25"))
    assert 0 < m["rollout_corr/rollout_is_oob_ratio"] < 1
    _, _, m = _ours(train, rollout, mask, dict(rollout_is="token", rollout_is_threshold=1.5))
    assert 0 < m["rollout_corr/rollout_is_ratio_fraction_high"] < 1
    for option in RS_OPTIONS:
        thresholds = {"k1": "0.7_1.3", "k2": 0.05, "k3": 0.02}
        _, new_mask, m = _ours(train, rollout, mask, dict(rollout_rs=option, rollout_rs_threshold=thresholds[option[-2:]]))
        assert 0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1, option


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_equal_verls_factories(name):
    want = getattr(RolloutCorrectionConfig, name)()
    got = preset(name)
    assert got == {k: getattr(want, k) for k in KEYS}


def test_every_verl_factory_has_a_preset():
    factories = {n for n, v in vars(RolloutCorrectionConfig).items() if isinstance(v, classmethod)}
    assert factories == set(PRESETS)


@pytest.mark.parametrize("spec", [0.0, -1.0, "", "abc", "3_2", "0_2", "1_x", True])
def test_bad_is_thresholds_rejected_like_verl(spec):
    with pytest.raises((ValueError, TypeError)):
        H._parse_rollout_is_threshold(spec)
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        parse_rollout_correction(rollout_is="token", rollout_is_threshold=spec)


@pytest.mark.parametrize("options, spec", [
    ("token_k1", None), ("token_k1", "2_1"), ("seq_mean_k3", "0.1_0.2"), ("seq_mean_k3", -0.5),
    ("token_k1,seq_max_k2", "0.5_2,0.1,0.2"), ("seq_max_k1", 0.1), ("token_k3", "x"), ("seq_sum_k2", 0.0)])
def test_bad_rejection_settings_rejected_like_verl(options, spec):
    mask = torch.ones(2, 3, dtype=torch.float64)
    with pytest.raises((ValueError, TypeError)):
        H.compute_rollout_rejection_mask(torch.zeros(2, 3, dtype=torch.float64), mask, options, spec)
    with pytest.raises(ValueError, match=r"rollout_rs(_threshold)?"):
        parse_rollout_correction(rollout_rs=options, rollout_rs_threshold=spec)


def _verl_actor_cfg(agg, correction):
    policy_loss = PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=RolloutCorrectionConfig(**correction))
    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                           clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=agg,
                           policy_loss=policy_loss)


BYPASS = [
    ("ppo_clip", dict(loss_type="ppo_clip", rollout_is=None)),
    ("ppo_clip-geo-rs", dict(loss_type="ppo_clip", rollout_is=None, rollout_rs="seq_mean_k1",
                             rollout_rs_threshold="0.9_1.1")),
    ("ppo_clip-is-metrics", dict(loss_type="ppo_clip", rollout_is="token", rollout_is_threshold=1.5)),
    ("reinforce-seq-is", dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=2.0)),
    ("reinforce-token-icepop-norm", dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.5_1.5",
                                         rollout_is_batch_normalize=True)),
    ("reinforce-seq-norm-rs", dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=3.0,
                                   rollout_is_batch_normalize=True, rollout_rs="token_k2,seq_max_k3",
                                   rollout_rs_threshold="0.1,0.2")),
    ("reinforce-no-is", dict(loss_type="reinforce", rollout_is=None, rollout_rs="token_k1",
                             rollout_rs_threshold="0.7_1.4")),
]


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("name, correction", BYPASS, ids=[n for n, _ in BYPASS])
def test_bypass_loss_and_gradient_match_verl(name, correction, agg):
    """verl's bypass loss on the whole mini-batch (one micro-batch on one rank: its in-loss statistics
    are then the mini-batch's) against Ballast's loss shares over a cut into two micro-batches, with
    the batch normaliser summed over the mini-batch as the engine does: loss, gradient, ppo_kl."""
    _, rollout, mask = _fixture(2, spread=0.2)
    gen = torch.Generator().manual_seed(5)
    log_prob_v = (rollout + torch.randn(B, R, generator=gen, dtype=torch.float64) * 0.2).requires_grad_(True)
    log_prob_b = log_prob_v.detach().clone().requires_grad_(True)
    advantages = torch.randn(B, R, generator=gen, dtype=torch.float64) * mask
    settings = dict(bypass_mode=True, **correction)
    scale = 5.0 if agg == "seq-mean-token-sum-norm" else None
    verl_cfg = _verl_actor_cfg(agg, settings)
    verl_cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B,
                                      loss_scale_factor=scale)
    want_loss, want_metrics = V.compute_policy_loss_bypass_mode(
        old_log_prob=rollout, log_prob=log_prob_v, advantages=advantages, response_mask=mask, loss_agg_mode=agg,
        config=verl_cfg)
    want_loss.backward()

    corr = parse_rollout_correction(**settings)
    cfg = ActorLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=agg, loss_scale_factor=scale,
                          rollout_correction=corr)
    norm = GlobalNorm(num_tokens=int(mask.sum()), num_sequences=B, response_len=R)
    stat = actor_loss_stats(cfg)
    assert (stat is not None) == corr.normalises_in_loss
    cuts = (slice(0, 6), slice(6, B))
    if stat is not None:
        sums = [stat({"log_probs": log_prob_b[c].detach()}, {"rollout_log_probs": rollout[c], "response_mask": mask[c]})
                for c in cuts]
        norm = norm.with_stats({k: float(sum(s[i] for s in sums)) for i, k in enumerate(stat.keys)})
    got_loss, got_kl = 0.0, 0.0
    for c in cuts:
        micro = {"rollout_log_probs": rollout[c], "advantages": advantages[c], "response_mask": mask[c]}
        part, metrics = actor_loss({"log_probs": log_prob_b[c]}, micro, norm, cfg=cfg)
        got_loss, got_kl = got_loss + part, got_kl + float(metrics["actor/ppo_kl"])
    got_loss.backward()
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(log_prob_b.grad, log_prob_v.grad, **TOL)
    if "rollout_rs" not in correction:  # with rejection verl averages over the kept tokens of each micro-batch
        assert got_kl == pytest.approx(float(want_metrics["actor/ppo_kl"]), abs=1e-6)
