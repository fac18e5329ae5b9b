"""Rollout-correction metrics under verl 0.9.1's names (`rollout_corr/*`), over one whole batch.

Three families, each a pure function of (B, R) tensors:

* `offpolicy_metrics`: how far the rollout policy is from the training policy: `kl` (mean of
  log pi_rollout - log pi_train over tokens), `k3_kl`, both perplexities and their log difference
  and ratio (per sequence, then averaged), and the chi-square divergences of the token and
  sequence ratios;
* `is_metrics`: the importance weights before batch normalisation: mean/max/min/std, the share
  beyond the bounds (`rollout_is_ratio_fraction_high/low`), the effective sample size, per-sequence
  summaries, and `rollout_is_oob_ratio` for IcePop;
* `rs_metrics`: per rejection option its statistic (mean/max/min/std, shares beyond the bounds,
  per-sequence summaries) and the share of tokens and sequences it rejects, then the share rejected
  by all options together (`rollout_rs_masked_fraction`, `rollout_rs_seq_masked_fraction`).

The driver computes them over the whole step (see `ballast.trainer.step.rollout_correction`), so
they are exact whatever the cut; the parity tests hold each value to verl's within 1e-6.
"""

from __future__ import annotations

import math
from typing import Dict, Sequence

import torch

from ballast.trainer.algorithms.rollout_correction import (SAFETY_BOUND, Correction, CriterionResult, ISWeights,
                                                           RolloutCorrection, bounds, masked_mean, masked_sum)

PREFIX = "rollout_corr/"


def _f(value) -> float:
    return float(value.detach()) if torch.is_tensor(value) else float(value)


def offpolicy_metrics(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                      mask: torch.Tensor) -> Dict[str, float]:
    """The mismatch between the policy that trains and the one that sampled (names without prefix)."""
    mask = mask.to(train_log_probs.dtype)
    seq_train = masked_mean(train_log_probs, mask, -1)
    seq_rollout = masked_mean(rollout_log_probs, mask, -1)
    log_ratio = train_log_probs - rollout_log_probs
    log_ppl_diff = seq_rollout - seq_train
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_log_ratio = masked_sum(log_ratio, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": _f(torch.exp(-seq_train).mean()),
        "training_log_ppl": _f((-seq_train).mean()),
        "kl": _f(masked_mean(rollout_log_probs - train_log_probs, mask)),
        "k3_kl": _f(masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)),
        "rollout_ppl": _f(torch.exp(-seq_rollout).mean()),
        "rollout_log_ppl": _f((-seq_rollout).mean()),
        "log_ppl_diff": _f(log_ppl_diff.mean()),
        "log_ppl_abs_diff": _f(log_ppl_diff.abs().mean()),
        "log_ppl_diff_max": _f(log_ppl_diff.max()),
        "log_ppl_diff_min": _f(log_ppl_diff.min()),
        "ppl_ratio": _f(torch.exp(log_ppl_diff).mean()),
        "chi2_token": _f(masked_mean(rho.square(), mask) - 1.0),
        "chi2_seq": _f(torch.exp(2.0 * seq_log_ratio).mean() - 1.0),
    }


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> float:
    """Std over the mask of `values` clamped to [low, high] (0 for one token or none)."""
    if float(mask.sum()) <= 1:
        return 0.0
    clamped = values.clamp(min=low, max=high)
    var = masked_mean(clamped.square(), mask) - masked_mean(clamped, mask).square()
    return _f(torch.sqrt(var.clamp(min=0.0)))


def _seq_summary(prefix: str, values: torch.Tensor) -> Dict[str, float]:
    return {
        f"{prefix}_seq_mean": _f(values.mean()),
        f"{prefix}_seq_std": _f(values.std()) if values.numel() > 1 else 0.0,
        f"{prefix}_seq_max": _f(values.max()),
        f"{prefix}_seq_min": _f(values.min()),
    }


def is_metrics(w: ISWeights, mask: torch.Tensor, corr: RolloutCorrection) -> Dict[str, float]:
    """Statistics of the importance weights before batch normalisation (names without prefix)."""
    mask = mask.to(w.weights.dtype)
    upper = corr.is_upper
    lower = corr.is_lower if corr.is_lower is not None else 1.0 / upper
    m: Dict[str, float] = {"rollout_is_mean": _f(masked_mean(w.weights, mask))}
    if corr.rollout_is == "sequence":  # over every row's log of the sequence ratio, unclamped below
        m["rollout_is_max"] = math.exp(min(_f(w.log_ratio.max()), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(_f(w.log_ratio.min()))
        m["rollout_is_ratio_fraction_high"] = _f((w.log_ratio > math.log(upper)).float().mean())
        m["rollout_is_ratio_fraction_low"] = _f((w.log_ratio < math.log(lower)).float().mean())
    else:
        m["rollout_is_ratio_fraction_high"] = _f(masked_mean((w.raw > upper).to(mask.dtype), mask))
        m["rollout_is_ratio_fraction_low"] = _f(masked_mean((w.raw < lower).to(mask.dtype), mask))
        valid = mask.bool()
        m["rollout_is_max"] = _f(w.weights.masked_fill(~valid, float("-inf")).max())
        m["rollout_is_min"] = _f(w.weights.masked_fill(~valid, float("inf")).min())
    m["rollout_is_std"] = _clamped_std(w.weights, mask, 0.0, upper)
    bounded = w.weights.clamp(min=0.0, max=upper)
    scaled = bounded / (masked_mean(bounded, mask) + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / _f(masked_mean(scaled.square(), mask))
    seq_mean = masked_mean(w.weights, mask, -1)
    m.update(_seq_summary("rollout_is", seq_mean))
    m["rollout_is_seq_max_deviation"] = _f((seq_mean - 1.0).abs().max())
    raw_seq_mean = masked_mean(w.raw, mask, -1)
    m["rollout_is_seq_fraction_high"] = _f((raw_seq_mean > upper).float().mean())
    m["rollout_is_seq_fraction_low"] = _f((raw_seq_mean < lower).float().mean())
    if corr.is_lower is not None:
        outside = (w.raw < corr.is_lower) | (w.raw > corr.is_upper)
        m["rollout_is_oob_ratio"] = _f(masked_mean(outside.to(mask.dtype), mask))
    return m


def _criterion_metrics(r: CriterionResult, mask: torch.Tensor) -> Dict[str, float]:
    c, stat = r.criterion, r.token_stat
    k1 = c.statistic == "k1"
    lower, upper = bounds(c)
    prefix = f"rollout_rs_{c.option}"
    valid_seq = mask.sum(-1) > 0
    seq_values = (r.seq_stat if r.seq_stat is not None else masked_mean(stat, mask, -1))[valid_seq]
    m: Dict[str, float] = {f"{prefix}_mean": _f(masked_mean(stat, mask))}
    if c.level == "sequence" and seq_values.numel():
        m[f"{prefix}_max"], m[f"{prefix}_min"] = _f(seq_values.max()), _f(seq_values.min())
        m[f"{prefix}_fraction_high"] = _f((seq_values > upper).float().mean())
        m[f"{prefix}_fraction_low"] = _f((seq_values < lower).float().mean()) if k1 else 0.0
    else:
        valid = mask.bool()
        m[f"{prefix}_max"] = _f(stat.masked_fill(~valid, float("-inf")).max())
        m[f"{prefix}_min"] = _f(stat.masked_fill(~valid, float("inf")).min())
        m[f"{prefix}_fraction_high"] = _f(masked_mean((stat > upper).to(mask.dtype), mask))
        m[f"{prefix}_fraction_low"] = _f(masked_mean((stat < lower).to(mask.dtype), mask)) if k1 else 0.0
    m[f"{prefix}_std"] = _clamped_std(stat, mask, lower if k1 else 0.0, upper)
    if seq_values.numel():
        m.update(_seq_summary(prefix, seq_values))
        m[f"{prefix}_seq_max_deviation"] = _f(seq_values.abs().max())
        m[f"{prefix}_seq_fraction_high"] = _f((seq_values > upper).float().mean())
        if k1:
            m[f"{prefix}_seq_fraction_low"] = _f((seq_values < lower).float().mean())
    rejected = (~r.keep).to(mask.dtype)
    m[f"{prefix}_masked_fraction"] = _f(masked_mean(rejected, mask))
    seq_rejected = ((rejected * mask).sum(-1) > 0)[valid_seq]
    m[f"{prefix}_seq_masked_fraction"] = _f(seq_rejected.float().mean()) if seq_rejected.numel() else 0.0
    return m


def rs_metrics(keep: torch.Tensor, results: Sequence[CriterionResult], mask: torch.Tensor) -> Dict[str, float]:
    """Per-option statistics and rejected shares, then the shares all options reject together."""
    mask = mask.to(keep.dtype)
    m: Dict[str, float] = {}
    for r in results:
        m.update(_criterion_metrics(r, mask))
    m["rollout_rs_masked_fraction"] = _f(masked_mean(1.0 - keep, mask))
    # over every row, as verl (a row without response tokens counts as not rejected)
    m["rollout_rs_seq_masked_fraction"] = _f((((keep <= 0.5) & mask.bool()).any(-1)).float().mean())
    return m


def prefixed(metrics: Dict[str, float]) -> Dict[str, float]:
    return {PREFIX + key: value for key, value in metrics.items()}


def correction_metrics(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                       corr: RolloutCorrection, c: Correction) -> Dict[str, float]:
    """Every `rollout_corr/*` metric of one batch and its `Correction` (`mask`: before rejection)."""
    if not bool(mask.bool().any()):
        return {}  # nothing was sampled: no statistic is defined
    m: Dict[str, float] = {}
    if c.weights is not None:
        m.update(is_metrics(c.weights, mask, corr))
    if c.keep is not None:
        m.update(rs_metrics(c.keep, c.criteria, mask))
    m.update(offpolicy_metrics(train_log_probs, rollout_log_probs, mask))
    return prefixed(m)
