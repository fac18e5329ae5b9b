"""Rollout correction through the whole driver loop on the tiny task, with a real rollout/training
mismatch (the rollout samples with top-k, so its log-probs are renormalised over the kept tokens):
decoupled mode makes exactly ONE old-log-prob pass per step, bypass mode none, and both log verl's
`rollout_corr/*` metrics every step."""

import json
import math
import os

import pytest

from ballast.trainer.config import load_config
from ballast.trainer.main import prepare_typed, training_session

from testkit.e2e import overrides, run_dir

RC = "algorithm.rollout_correction"
MISMATCH = ["actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.rollout.top_k=128",
            "trainer.total_training_steps=2"]
ALWAYS = ["rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/training_ppl", "rollout_corr/rollout_ppl",
          "rollout_corr/chi2_token", "rollout_corr/chi2_seq", "rollout_corr/log_ppl_diff"]


@pytest.fixture()
def session(tiny_task, e2e_ray, tmp_path):
    def make(name, *extra):
        return training_session(prepare_typed(load_config(overrides(tiny_task, run_dir(tmp_path, name), *MISMATCH,
                                                                    *extra))))

    return make


def _count_calls(group, method):
    calls = []
    original = getattr(group, method)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(group, method, counted)
    return calls


def _rows(tmp_path, name):
    return [json.loads(line) for line in open(os.path.join(tmp_path, name, "metrics.jsonl"))]


def _finite(row, keys):
    missing = [k for k in keys if k not in row]
    assert not missing, f"missing {missing}"
    assert all(math.isfinite(row[k]) for k in keys), {k: row[k] for k in keys}


def test_decoupled_mode_makes_one_old_log_prob_pass_and_corrects(session, tmp_path):
    extra = [f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_batch_normalize=True", f"{RC}.rollout_rs=token_k1",
             f"{RC}.rollout_rs_threshold=0.25_2.98"]
    with session("decoupled", *extra) as trainer:
        assert trainer.old_log_probs.mode == "pass"  # two mini-batches would otherwise take them from the update
        calls = _count_calls(trainer.workers.actor_rollout, "compute_log_prob")
        trainer.fit()
    assert len(calls) == 2  # one per step
    keys = ALWAYS + ["rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_batch_norm_factor",
                     "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/rollout_rs_masked_fraction",
                     "rollout_corr/rollout_rs_token_k1_masked_fraction", "timing_s/rollout_corr"]
    rows = _rows(tmp_path, "decoupled")
    for row in rows:
        _finite(row, keys)
        assert row["rollout_corr/k3_kl"] > 1e-4  # top-k sampling really differs from the trained policy
        assert row["rollout_corr/kl"] > 0  # renormalised over the top k: the rollout's log-probs are higher
        assert 0 <= row["rollout_corr/rollout_rs_masked_fraction"] < 1
    # the tiny model's k1 sits in a narrow band (~1.07-1.14 nats); the bound (log 2.98 = 1.092) cuts into it
    assert max(row["rollout_corr/rollout_rs_masked_fraction"] for row in rows) > 0


def test_bypass_mode_makes_no_old_log_prob_pass(session, tmp_path):
    extra = ["+algorithm/rollout_correction=bypass_pg_token_icepop", f"{RC}.rollout_is_threshold=0.334_5.0",
             f"{RC}.rollout_is_batch_normalize=True",
             f"{RC}.rollout_rs=seq_max_k3", f"{RC}.rollout_rs_threshold=5.0"]
    with session("bypass", *extra) as trainer:
        assert trainer.old_log_probs.mode == "rollout"
        calls = _count_calls(trainer.workers.actor_rollout, "compute_log_prob")
        metrics = trainer.fit()
    assert calls == []
    assert "timing_s/old_log_prob" not in metrics and "perf/mfu/actor_infer" not in metrics
    keys = ALWAYS + ["rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_oob_ratio",
                     "rollout_corr/rollout_is_batch_norm_factor", "rollout_corr/rollout_rs_seq_max_k3_max",
                     "training/rollout_actor_log_prob_diff/mean", "actor/ppo_kl", "actor/pg_loss"]
    rows = _rows(tmp_path, "bypass")
    for row in rows:
        _finite(row, keys)
        assert row["rollout_corr/k3_kl"] > 1e-4
        assert 0 <= row["rollout_corr/rollout_is_oob_ratio"] < 1
    # token ratios sit near exp(-1.1) = 0.33 here; the lower bound 0.334 zeroes some of them
    assert max(row["rollout_corr/rollout_is_oob_ratio"] for row in rows) > 0
