"""Rollout correction: importance weights and rejection masks for the rollout/training mismatch.

The rollout engine samples from pi_rollout (other kernels, another precision, possibly stale weights);
training differentiates pi_theta. With the per-token log-ratio log r = log pi_train - log pi_rollout
(pi_train: the old policy in decoupled mode, the policy being trained in bypass mode):

* importance sampling (`rollout_is`): a weight per token (r) or per sequence (prod r over the
  response), truncated from above (TIS: min(w, upper)) or, with a "lower_upper" threshold, zeroed
  outside [lower, upper] (IcePop); optionally divided by its mean over the mini-batch;
* rejection (`rollout_rs`): tokens or whole sequences whose divergence statistic leaves its bounds
  are dropped from the loss mask. Statistics per token: k1 = -log r, k2 = (log r)^2 / 2,
  k3 = r - 1 - log r; aggregated per token, or per sequence as sum, mean or max. k1 options take
  ratio bounds "lower_upper" (a single number u means 1/u_u); k2 and k3 an upper bound.

Beyond verl's options, Ballast offers the masks other trainers use, on the same footing (Ballast
extensions, not verl keys): `token_tv` / `seq_max_tv`, the absolute difference of the sampled
token's probabilities |p_train - p_rollout| (DPPO-style trust-region masks); `token_bkl` /
`seq_max_bkl`, the KL between the two Bernoulli distributions "this token or not" (binary KL, KPop);
`seq_max_absk1`, |log r| of a sequence's worst token against a ratio bound u (any token outside
[1/u, u] drops the whole sequence: an outlier-sequence mask).

Keys, value syntax and semantics follow verl 0.9.1's `algorithm.rollout_correction` (the parity
tests compare every function here with verl's on float64 inputs). One deliberate difference: the
batch normaliser of `rollout_is_batch_normalize` is the mean over exactly one MINI-BATCH, across
every DP rank (`normaliser_sums` are additive, summed by the engine, see `ballast.engine.losses`),
so a mini-batch's gradient does not depend on how it is cut. verl normalises over the whole step
batch in decoupled mode and over each micro-batch in bypass mode; all three agree when a step is
one mini-batch of one micro-batch.

Everything here is a pure function of tensors; metrics live in `rollout_correction_metrics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

# exp(+-20) bounds every exponentiated log-ratio (verl's safety bound).
SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
# Ballast's extensions (see the module docstring); same threshold rules: absk1 takes a ratio u.
RS_EXTENSIONS = ("token_tv", "seq_max_tv", "token_bkl", "seq_max_bkl", "seq_max_absk1")
KEY = "algorithm.rollout_correction"


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of `values` where `mask` is non-zero (NaNs outside the mask ignored)."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values)) * mask
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of `values` over `mask`; 0 where the mask is empty (the 1e-8 keeps verl's convention)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


# ------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class RejectionCriterion:
    """One `rollout_rs` option with its bounds: ratio bounds `lower`..`upper` for k1 options (the k1
    statistic is compared with their logs, as verl does), only `upper` (a divergence) for k2/k3."""

    option: str
    upper: float
    lower: Optional[float] = None

    @property
    def statistic(self) -> str:
        """"k1", "k2", "k3", "tv", "bkl" or "absk1"."""
        return self.option.rsplit("_", 1)[-1]

    @property
    def aggregate(self) -> str:
        """"token", "sum", "mean" or "max"."""
        return "token" if self.option.startswith("token") else self.option.split("_")[1]

    @property
    def level(self) -> str:
        return "token" if self.aggregate == "token" else "sequence"


@dataclass(frozen=True)
class RolloutCorrection:
    """`algorithm.rollout_correction`, parsed and checked (`parse_rollout_correction`)."""

    rollout_is: Optional[str] = None
    is_upper: float = 2.0
    is_lower: Optional[float] = None  # set: IcePop (zero outside [lower, upper]); None: TIS
    batch_normalize: bool = False
    rejection: tuple[RejectionCriterion, ...] = ()
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    @property
    def corrects(self) -> bool:
        """Whether weights or masks change the loss (otherwise: metrics only)."""
        return self.rollout_is is not None or bool(self.rejection)

    @property
    def needs_old_log_probs_before_update(self) -> bool:
        """Decoupled mode with a correction: the driver needs pi_old before the update."""
        return not self.bypass_mode and self.corrects

    @property
    def weights_in_loss(self) -> bool:
        """Whether the loss multiplies by IS weights (bypass + ppo_clip only reports them)."""
        return self.rollout_is is not None and (not self.bypass_mode or self.loss_type == "reinforce")

    @property
    def normalises_in_loss(self) -> bool:
        """Whether the loss divides the weights by their mini-batch mean (a global statistic)."""
        return self.batch_normalize and self.weights_in_loss


def parse_is_threshold(spec, key: str = f"{KEY}.rollout_is_threshold") -> tuple[float, Optional[float]]:
    """(upper, lower or None) from a number (TIS upper bound) or "lower_upper" (IcePop)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{key}={spec!r} must be a number or a 'lower_upper' string such as '0.5_5.0'")
    text = str(spec).strip()
    try:
        if "_" in text:
            lower_text, upper_text = text.split("_", 1)
            lower, upper = float(lower_text), float(upper_text)
        else:
            lower, upper = None, float(text)
    except ValueError:
        raise ValueError(f"{key}={spec!r} is not a number or a 'lower_upper' pair of numbers") from None
    if not upper > 0 or (lower is not None and not lower > 0):
        raise ValueError(f"{key}={spec!r}: the bounds must be positive")
    if lower is not None and lower > upper:
        raise ValueError(f"{key}={spec!r}: the lower bound must be <= the upper bound")
    return upper, lower


def parse_rs_options(spec, key: str = f"{KEY}.rollout_rs") -> tuple[str, ...]:
    """The comma-separated `rollout_rs` options (a list of them is accepted too), checked, duplicates
    dropped, order kept."""
    if isinstance(spec, (list, tuple)) and all(isinstance(part, str) for part in spec):
        spec = ",".join(spec)
    if not isinstance(spec, str):
        raise ValueError(f"{key}={spec!r} must be a comma-separated string of options, e.g. 'seq_mean_k3'")
    options = []
    for option in (part.strip() for part in spec.split(",")):
        if not option:
            continue
        if option not in RS_OPTIONS + RS_EXTENSIONS:
            raise ValueError(f"{key}: {option!r} is not one of {', '.join(RS_OPTIONS)} "
                             f"(or Ballast's {', '.join(RS_EXTENSIONS)})")
        if option not in options:
            options.append(option)
    if not options:
        raise ValueError(f"{key}={spec!r} names no option")
    return tuple(options)


def parse_rs_thresholds(options: Sequence[str], spec, key: str = f"{KEY}.rollout_rs_threshold"
                        ) -> tuple[RejectionCriterion, ...]:
    """One criterion per option: `spec` holds one threshold for all options or one per option
    (comma-separated); k1 options take "lower_upper" ratio bounds (a lone u means 1/u and u)."""
    if spec is None:
        raise ValueError(f"{key} must be set when {KEY}.rollout_rs is (e.g. {key}=0.01 or '0.5_2.0')")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{key}={spec!r} must be a number or a string")
    parts = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"{key}={spec!r} has {len(parts)} thresholds for {len(options)} rollout_rs options: "
                         "give one for all or one per option")
    parts = parts * len(options) if len(parts) == 1 else parts
    return tuple(_criterion(option, part, key) for option, part in zip(options, parts))


def _criterion(option: str, text: str, key: str) -> RejectionCriterion:
    where = f"{key}={text!r} for {option}"
    try:
        if option.endswith("k1"):
            lower_text, upper_text = text.split("_", 1) if "_" in text else (None, text)
            upper = float(upper_text)
            lower = float(lower_text) if lower_text is not None else 1.0 / upper
        elif "_" in text:
            raise ValueError(f"{where}: only k1 options take 'lower_upper'; this one takes one upper bound")
        else:
            upper, lower = float(text), None
    except ZeroDivisionError:
        raise ValueError(f"{where}: the bounds must be positive") from None
    except ValueError as err:
        raise ValueError(str(err) if str(err).startswith(key) else f"{where} is not a number") from None
    if not upper > 0 or (lower is not None and not lower > 0):
        raise ValueError(f"{where}: the bounds must be positive")
    if lower is not None and lower > upper:
        raise ValueError(f"{where}: the lower bound must be <= the upper bound")
    return RejectionCriterion(option, upper, lower)


def parse_rollout_correction(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                             rollout_rs=None, rollout_rs_threshold=None, bypass_mode=False,
                             loss_type="ppo_clip") -> RolloutCorrection:
    """The settings of `algorithm.rollout_correction` (verl's keys and value syntax), checked; a
    ValueError names the offending key."""
    if rollout_is is not None and rollout_is not in IS_LEVELS:
        raise ValueError(f"{KEY}.rollout_is={rollout_is!r} must be null, 'token' or 'sequence'")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"{KEY}.loss_type={loss_type!r} must be one of {', '.join(LOSS_TYPES)}")
    for name, value in (("rollout_is_batch_normalize", rollout_is_batch_normalize), ("bypass_mode", bypass_mode)):
        if not isinstance(value, bool):
            raise ValueError(f"{KEY}.{name}={value!r} must be true or false")
    if rollout_is_batch_normalize and rollout_is is None:
        raise ValueError(f"{KEY}.rollout_is_batch_normalize=true normalises importance weights, but "
                         f"{KEY}.rollout_is is null: set rollout_is=token or sequence, or the switch off")
    if loss_type != "ppo_clip" and not bypass_mode:
        raise ValueError(f"{KEY}.loss_type={loss_type!r} chooses bypass mode's loss; set {KEY}.bypass_mode=true "
                         "(decoupled mode uses actor_rollout_ref.actor.policy_loss.loss_mode)")
    if bypass_mode and loss_type == "ppo_clip" and rollout_is_batch_normalize:
        raise ValueError(f"{KEY}.rollout_is_batch_normalize=true has no effect with bypass_mode=true and "
                         "loss_type=ppo_clip (the clipped ratio corrects; the weights are only reported)")
    upper, lower = parse_is_threshold(rollout_is_threshold)
    rejection = ()
    if rollout_rs is not None:
        rejection = parse_rs_thresholds(parse_rs_options(rollout_rs), rollout_rs_threshold)
    return RolloutCorrection(rollout_is, upper, lower, rollout_is_batch_normalize, rejection, bypass_mode, loss_type)


# ------------------------------------------------------------------------------------------ weights
@dataclass(frozen=True)
class ISWeights:
    weights: torch.Tensor  # (B, R) truncated (TIS) or zeroed outside the bounds (IcePop); 0 on padding
    raw: torch.Tensor      # (B, R) before truncation; 0 on padding
    log_ratio: torch.Tensor  # (B, R) per token, or (B, 1) per sequence: what the metrics read


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, corr: RolloutCorrection) -> ISWeights:
    """Importance weights (not batch-normalised) of `corr.rollout_is` level from the log-ratio."""
    mask = mask.to(log_ratio.dtype)
    if corr.rollout_is == "token":
        for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif corr.rollout_is == "sequence":
        for_metrics = masked_sum(log_ratio, mask, -1).unsqueeze(-1)
        raw = torch.exp(for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    else:
        raise ValueError(f"rollout_is={corr.rollout_is!r} computes no weights")
    raw = raw * mask
    if corr.is_lower is None:
        weights = raw.clamp(max=corr.is_upper)
    else:
        inside = (raw >= corr.is_lower) & (raw <= corr.is_upper)
        weights = torch.where(inside, raw, torch.zeros_like(raw))
    return ISWeights(weights.detach(), raw.detach(), for_metrics.detach())


def normaliser_terms(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Each row's (numerator, count) terms of the batch mean of the weights, float64 (B, 2): the token
    mean sums weights and tokens; the sequence mean sums each sequence's mean weight and counts the
    sequences with at least one token. Sums of these over any split of the rows add up exactly."""
    mask = mask.to(weights.dtype)
    if level == "token":
        terms = (masked_sum(weights, mask, -1), mask.sum(-1))
    else:
        valid = (mask.sum(-1) > 0).to(weights.dtype)
        terms = (masked_mean(weights, mask, -1) * valid, valid)
    return torch.stack([t.to(torch.float64) for t in terms], dim=-1)


def normaliser_sums(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """(numerator, count) of the batch mean of the weights over these rows, float64 (2,)."""
    return normaliser_terms(weights, mask, level).sum(0)


def normaliser(sums: torch.Tensor, level: str) -> float:
    """The batch mean from `normaliser_sums` summed over the whole batch."""
    total, count = float(sums[0]), float(sums[1])
    return total / (count + 1e-8) if level == "token" else total / max(count, 1e-8)


def normalise(weights: torch.Tensor, mean: float) -> torch.Tensor:
    """Weights divided by their batch mean (left alone when the mean is ~0, as verl)."""
    return weights / mean if mean > 1e-8 else weights


# ------------------------------------------------------------------------------------------ rejection
@dataclass(frozen=True)
class CriterionResult:
    criterion: RejectionCriterion
    token_stat: torch.Tensor           # (B, R): the statistic per token (a sequence's value on every token)
    seq_stat: Optional[torch.Tensor]   # (B,) for sequence-level criteria
    keep: torch.Tensor                 # (B, R) bool, over every position (padding included)


def _divergences(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, needed) -> dict:
    """Per-token statistics (only the `needed` ones)."""
    safe = (train_log_probs - rollout_log_probs).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe, "absk1": safe.abs()}
    if {"tv", "bkl"} & set(needed):
        lp, lq = train_log_probs.clamp(max=0.0), rollout_log_probs.clamp(max=0.0)
        p, q = lp.exp(), lq.exp()
        out["tv"] = (p - q).abs()
        # log(1 - p) from -expm1(log p), floored: a token of probability ~1 has no "other" mass
        l1p, l1q = (-torch.expm1(lp)).clamp(min=1e-12).log(), (-torch.expm1(lq)).clamp(min=1e-12).log()
        out["bkl"] = (q * (lq - lp) + (1.0 - q) * (l1q - l1p)).clamp(min=0.0)  # KL(Bern(q) || Bern(p))
    return out


def _sequence_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    top = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(top) & (top < 0), torch.zeros_like(top), top)


def bounds(c: RejectionCriterion) -> tuple[float, float]:
    """(lower, upper) on the statistic's own scale: logs of the ratio bounds for k1 and absk1."""
    if c.statistic == "k1":
        return math.log(c.lower), math.log(c.upper)
    return 0.0, math.log(c.upper) if c.statistic == "absk1" else c.upper


def _inside(stat: torch.Tensor, c: RejectionCriterion) -> torch.Tensor:
    lower, upper = bounds(c)
    if c.statistic == "k1":  # ratio bounds, compared in log space
        return (stat >= lower) & (stat <= upper)
    return stat <= upper


def rejection(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
              criteria: Sequence[RejectionCriterion]) -> tuple[torch.Tensor, list[CriterionResult]]:
    """(keep mask (B, R) in the log-probs' dtype: 1 where every criterion passes, over all
    positions; per-criterion results for the metrics)."""
    mask = mask.to(train_log_probs.dtype)
    token = _divergences(train_log_probs, rollout_log_probs, [c.statistic for c in criteria])
    keep = torch.ones_like(train_log_probs)
    results = []
    for c in criteria:
        per_token, seq = token[c.statistic], None
        if c.aggregate == "sum":
            seq = masked_sum(per_token, mask, -1)
        elif c.aggregate == "mean":
            seq = masked_mean(per_token, mask, -1)
        elif c.aggregate == "max":
            seq = _sequence_max(per_token, mask)
        if seq is not None:
            per_token = seq.unsqueeze(-1).expand_as(train_log_probs)
        passed = _inside(per_token, c)
        keep = keep * passed.to(train_log_probs.dtype)
        results.append(CriterionResult(c, per_token, seq, passed))
    return keep, results


# ------------------------------------------------------------------------------------------ together
@dataclass(frozen=True)
class Correction:
    """What `correct` makes of one batch: weights NOT yet batch-normalised (None without
    `rollout_is`), the loss mask after rejection, and what the metrics read."""

    weights: Optional[ISWeights]
    mask: torch.Tensor
    keep: Optional[torch.Tensor]
    criteria: tuple[CriterionResult, ...]


def correct(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
            corr: RolloutCorrection) -> Correction:
    """Weights and rejection of a batch, row by row (nothing here depends on other rows, so a batch
    may be corrected in any pieces; the batch normaliser is taken apart: `normaliser_sums`)."""
    if train_log_probs.shape != rollout_log_probs.shape or train_log_probs.shape != mask.shape:
        raise ValueError(f"log-prob shapes {tuple(train_log_probs.shape)} / {tuple(rollout_log_probs.shape)} and "
                         f"mask shape {tuple(mask.shape)} differ")
    log_ratio = train_log_probs - rollout_log_probs
    weights = is_weights(log_ratio, mask, corr) if corr.rollout_is is not None else None
    keep, results = (None, []) if not corr.rejection else rejection(train_log_probs, rollout_log_probs, mask,
                                                                    corr.rejection)
    new_mask = mask if keep is None else (mask * keep).to(mask.dtype)
    return Correction(weights, new_mask, keep, tuple(results))
