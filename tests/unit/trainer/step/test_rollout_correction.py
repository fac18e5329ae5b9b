"""Rollout correction without verl: start-up errors naming the key, presets on the command line, the
old-log-prob mode each setting forces, what the driver does to a step's batch, and that the batch
normaliser is the mini-batch's whatever the cut (the loss over micro-batch shares)."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from ballast.balance import MicroBatchMode, MicroBatchPolicy, plan_phase
from ballast.engine.losses import LOSS_AGG_MODES, GlobalNorm, mini_batch_statistic
from ballast.protocol import Batch
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, make_actor_loss
from ballast.trainer.algorithms.rollout_correction import (correct, normaliser, normaliser_terms,
                                                           parse_rollout_correction)
from ballast.trainer.algorithms.rollout_correction_metrics import correction_metrics
from ballast.trainer.algorithms.rollout_correction_presets import PRESETS
from ballast.trainer.config import load_config
from ballast.trainer.config.loader import CONFIG_DIR, ConfigError
from ballast.trainer.step.rollout_correction import (RolloutCorrectionPhase, loss_correction,
                                                      rollout_correction_settings)
from ballast.workers.on_policy import OldLogProbMode, old_log_prob_mode

BASE = ["data.train_files=x", "actor_rollout_ref.model.path=m", "actor_rollout_ref.rollout.calculate_log_probs=True"]
RC = "algorithm.rollout_correction"


def _settings(*overrides):
    return rollout_correction_settings(load_config(BASE + list(overrides)))


@pytest.mark.parametrize("overrides, key", [
    ([f"{RC}.rollout_is=tokens"], f"{RC}.rollout_is"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=5.0_0.5"], f"{RC}.rollout_is_threshold"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=-1"], f"{RC}.rollout_is_threshold"),
    ([f"{RC}.rollout_rs=seq_mean_k3"], f"{RC}.rollout_rs_threshold"),
    ([f"{RC}.rollout_rs=seq_mean_k4", f"{RC}.rollout_rs_threshold=0.1"], f"{RC}.rollout_rs"),
    ([f"{RC}.rollout_rs=seq_mean_k3", f"{RC}.rollout_rs_threshold=0.5_2.0"], f"{RC}.rollout_rs_threshold"),
    ([f"{RC}.rollout_rs='token_k1,seq_max_k2'", f"{RC}.rollout_rs_threshold='0.5_2,0.1,0.3'"],
     f"{RC}.rollout_rs_threshold"),
    ([f"{RC}.rollout_is_batch_normalize=true"], f"{RC}.rollout_is_batch_normalize"),
    ([f"{RC}.loss_type=reinforce"], f"{RC}.loss_type"),
    ([f"{RC}.bypass_mode=true", f"{RC}.loss_type=ppo"], f"{RC}.loss_type"),
    ([f"{RC}.bypass_mode=true", f"{RC}.rollout_is=token", f"{RC}.rollout_is_batch_normalize=true"],
     f"{RC}.rollout_is_batch_normalize"),
    ([f"{RC}.bypass_mode=true", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
     "actor_rollout_ref.actor.policy_loss.loss_mode"),
    ([f"{RC}.bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=False"],
     "actor_rollout_ref.rollout.calculate_log_probs"),
    ([f"{RC}.rollout_is=sequence", "actor_rollout_ref.rollout.calculate_log_probs=False"],
     "actor_rollout_ref.rollout.calculate_log_probs"),
])
def test_invalid_settings_are_start_up_errors_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _settings(*overrides)


def test_the_default_is_metrics_only_and_verls_value_syntax_parses():
    corr = _settings()
    assert not corr.corrects and not corr.bypass_mode and loss_correction(corr) is None
    corr = _settings(f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5_5.0",
                     f"{RC}.rollout_rs='token_k1,seq_max_k3'", f"{RC}.rollout_rs_threshold=2.0")
    assert (corr.is_lower, corr.is_upper) == (0.5, 5.0)
    assert [(c.option, c.lower, c.upper) for c in corr.rejection] == [("token_k1", 0.5, 2.0), ("seq_max_k3", None, 2.0)]



def test_a_verl_line_that_sets_only_a_correction_mode_runs():
    # verl's default rollout.calculate_log_probs=true: naming a correction needs nothing else (BASE sets
    # the log-probs explicitly; here they come from the default alone)
    for mode in ([f"{RC}.rollout_is=token"], [f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=0.5_2.0"],
                 [f"{RC}.bypass_mode=true"]):
        cfg = load_config(["data.train_files=x", "actor_rollout_ref.model.path=m", *mode])
        assert cfg.actor_rollout_ref.rollout.calculate_log_probs
        corr = rollout_correction_settings(cfg)
        assert corr.corrects or corr.bypass_mode

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_config_group_option_equal_to_its_table(name):
    path = Path(CONFIG_DIR) / "algorithm" / "rollout_correction" / f"{name}.yaml"
    assert yaml.safe_load(path.read_text()) == PRESETS[name]()
    cfg = load_config(BASE + [f"+algorithm/rollout_correction={name}"])
    section = cfg.algorithm.rollout_correction
    assert {k: getattr(section, k) for k in PRESETS[name]()} == PRESETS[name]()


def test_keys_after_a_preset_override_it():
    cfg = load_config(BASE + ["+algorithm/rollout_correction=decoupled_token_icepop", f"{RC}.rollout_is_threshold='0.2_9'"])
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == "0.2_9"


@pytest.mark.parametrize("value", ["0.2_9", "1_2", "2_5e1"])
def test_a_pair_hydra_would_read_as_a_number_is_refused(value):
    with pytest.raises(ConfigError, match=rf"{RC}\.rollout_rs_threshold={value} would be read as the number"):
        load_config(BASE + [f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold={value}"])
    load_config(BASE + [f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold='{value}'"])  # quoted: the pair


def test_each_setting_forces_its_old_log_prob_mode():
    decoupled = parse_rollout_correction(rollout_is="token")
    bypass = parse_rollout_correction(bypass_mode=True)
    metrics_only = parse_rollout_correction()
    kw = dict(use_kl_in_reward=False, enabled=True)
    assert old_log_prob_mode(4, 1, **kw, needed_before_update=decoupled.needs_old_log_probs_before_update) \
        is OldLogProbMode.PASS
    assert old_log_prob_mode(4, 1, **kw, needed_before_update=metrics_only.needs_old_log_probs_before_update) \
        is OldLogProbMode.PARTIAL
    assert old_log_prob_mode(4, 2, use_kl_in_reward=True, enabled=True, rollout_is_old=bypass.bypass_mode) \
        is OldLogProbMode.ROLLOUT
    assert not OldLogProbMode.ROLLOUT.from_update


B, R = 8, 6


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 4, 0, 6, 3, 5, 2])
    mask = (torch.arange(R)[None] < lengths[:, None]).long()
    old = -torch.rand(B, R, generator=gen) * 2 * mask
    rollout = (old + 0.4 * torch.randn(B, R, generator=gen)) * mask
    return Batch({"response_mask": mask, "old_log_probs": old, "rollout_log_probs": rollout,
                  "advantages": torch.randn(B, R, generator=gen) * mask})


def test_decoupled_step_sets_weights_terms_and_rejection_before_the_advantages():
    corr = parse_rollout_correction(rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
                                    rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4")
    batch = _batch()
    sampled = batch["response_mask"].clone()
    metrics = RolloutCorrectionPhase(corr).before_advantages(batch)
    c = correct(batch["old_log_probs"], batch["rollout_log_probs"], sampled, corr)
    torch.testing.assert_close(batch["response_mask"], c.mask)
    assert 0 < int(batch["response_mask"].sum()) < int(sampled.sum())
    torch.testing.assert_close(batch["rollout_is_weights"], c.weights.weights)
    terms = normaliser_terms(c.weights.weights, sampled, "sequence")  # over the sampled tokens, as verl
    torch.testing.assert_close(batch["rollout_is_norm_count"], terms[:, 1])
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] > 0 and "rollout_corr/kl" in metrics


def test_batch_norm_factor_is_each_mini_batchs_mean_over_every_epoch():
    corr = parse_rollout_correction(rollout_is="token", rollout_is_batch_normalize=True)
    batch = _batch(1)
    phase = RolloutCorrectionPhase(corr)
    phase.before_advantages(batch)
    plan = plan_phase(np.full(B, 10), 2, MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=2),
                      mini_batch_samples=4, epochs=2, shuffle=True, seed=0)
    terms = torch.stack([batch["rollout_is_norm_sum"], batch["rollout_is_norm_count"]], -1)
    want = np.mean([normaliser(terms[torch.as_tensor(np.concatenate(plan.partitions(m)))].sum(0), "token")
                    for m in range(len(plan.mini_batches))])
    got = phase.after_update(batch, plan, None)["rollout_corr/rollout_is_batch_norm_factor"]
    assert got == pytest.approx(want) and len(plan.mini_batches) == 4


def test_bypass_step_uses_rollout_log_probs_and_reports_on_train_time_log_probs():
    corr = parse_rollout_correction(bypass_mode=True, loss_type="reinforce", rollout_is="token")
    batch = _batch(2).select(["response_mask", "rollout_log_probs", "advantages"])  # a bypass step has no old ones
    phase = RolloutCorrectionPhase(corr)
    assert phase.before_advantages(batch) == {}
    plan = plan_phase(np.full(B, 10), 2, MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=2),
                      mini_batch_samples=4)
    trained = batch["rollout_log_probs"] + 0.1 * batch["response_mask"]
    ranks = [np.concatenate([plan.partitions(m)[r] for m in range(len(plan.mini_batches))]) for r in range(2)]
    results = [SimpleNamespace(train_log_probs=trained[torch.as_tensor(rows)]) for rows in ranks]
    metrics = phase.after_update(batch, plan, results)
    torch.testing.assert_close(batch["train_log_probs"], trained)
    assert metrics["rollout_corr/kl"] == pytest.approx(-0.1, abs=1e-6)
    assert "old_log_probs" not in batch


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("bypass", [False, True])
def test_normalised_loss_over_micro_batch_shares_equals_the_whole_mini_batch(agg, bypass):
    """The engine's recipe on plain tensors: the statistic summed over the cut, then loss shares."""
    settings = dict(rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_batch_normalize=True)
    corr = parse_rollout_correction(bypass_mode=bypass, loss_type="reinforce" if bypass else "ppo_clip", **settings)
    batch = _batch(3)
    if bypass:  # the loss reads the rollout's log-probs as the old policy's; no old_log_probs column
        batch = batch.select(["response_mask", "rollout_log_probs", "advantages"])
    phase = RolloutCorrectionPhase(corr)
    phase.before_advantages(batch)
    loss_fn = make_actor_loss(ActorLossConfig(loss_agg_mode=agg, rollout_correction=loss_correction(corr)))
    stat = mini_batch_statistic(loss_fn)
    log_prob = (batch["rollout_log_probs"] + 0.2).requires_grad_(True)
    norm = GlobalNorm.local(batch["response_mask"])

    def loss_over(cuts):
        parts = [stat({"log_probs": log_prob[c].detach()}, batch.tensors[c]) for c in cuts]
        n = norm.with_stats({k: float(sum(p[i] for p in parts)) for i, k in enumerate(stat.keys)})
        return sum(loss_fn({"log_probs": log_prob[c]}, batch.tensors[c], n)[0] for c in cuts)

    whole = loss_over([slice(0, B)])
    cut = loss_over([slice(0, 3), slice(3, 4), slice(4, B)])
    torch.testing.assert_close(cut, whole, rtol=1e-6, atol=1e-7)
    # and it is not the per-micro-batch normalisation (which would differ)
    local = sum(loss_fn({"log_probs": log_prob[c]}, batch.tensors[c], norm.with_stats(
        dict(zip(stat.keys, stat({"log_probs": log_prob[c].detach()}, batch.tensors[c])))))[0]
        for c in [slice(0, 3), slice(3, 4), slice(4, B)])
    assert abs(float(local.detach()) - float(whole.detach())) > 1e-4


def test_ballast_extension_masks_on_a_hand_example():
    """token_tv, token_bkl (Bernoulli KL of the sampled token), seq_max_absk1 (an outlier sequence)."""
    train = torch.log(torch.tensor([[0.5, 0.5, 0.3], [0.6, 0.7, 0.1]], dtype=torch.float64))
    rollout = torch.log(torch.tensor([[0.2, 0.5, 0.1], [0.4, 1.0, 0.1]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    corr = parse_rollout_correction(rollout_rs="token_tv", rollout_rs_threshold=0.25)
    torch.testing.assert_close(correct(train, rollout, mask, corr).mask, torch.tensor([[0, 1, 1], [1, 0, 0]]))
    bkl = 0.2 * np.log(0.2 / 0.5) + 0.8 * np.log(0.8 / 0.5)  # KL(Bern(0.2) || Bern(0.5)) = 0.1927
    for threshold, kept in ((bkl - 1e-6, 0), (bkl + 1e-6, 1)):
        corr = parse_rollout_correction(rollout_rs="token_bkl", rollout_rs_threshold=threshold)
        assert int(correct(train, rollout, mask, corr).mask[0, 0]) == kept
    # ratios 2.5, 1, 3 in row 0 (|log 3| > log 2: the whole row goes); 1.5, 0.7 in row 1 stay
    corr = parse_rollout_correction(rollout_rs="seq_max_absk1", rollout_rs_threshold=2.0)
    c = correct(train, rollout, mask, corr)
    torch.testing.assert_close(c.mask, torch.tensor([[0, 0, 0], [1, 1, 0]]))
    metrics = correction_metrics(train, rollout, mask, corr, c)
    assert metrics["rollout_corr/rollout_rs_seq_max_absk1_seq_masked_fraction"] == 0.5
    assert metrics["rollout_corr/rollout_rs_seq_max_absk1_max"] == pytest.approx(np.log(3.0))
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        parse_rollout_correction(rollout_rs="token_tv", rollout_rs_threshold="0.1_0.2")
