"""Policy losses (a registry) and the complete actor loss sent to the workers.

Every per-token quantity is aggregated with the engine's `agg_loss`, which normalises by
mini-batch-global counts; so the loss of each micro-batch is its exact share of the mini-batch loss
and the metrics below, computed the same way, add up over micro-batches and DP ranks to mini-batch
values.

Rollout correction (`ActorLossConfig.rollout_correction`, see `rollout_correction`) enters here in
two ways. Decoupled mode: the driver has put importance weights (`rollout_is_weights`, not yet
batch-normalised) and the rejection into the mask; every policy loss multiplies its per-token loss by
the weights (verl's `rollout_is_weights` argument). Bypass mode: the old policy IS the rollout's, whose
log-probs the loss reads from their own column (`rollout_log_probs`; the batch has no `old_log_probs`);
weights and rejection are computed here from the current log-probs, and the loss is PPO-clip against
the rollout policy (`ppo_clip`) or REINFORCE with explicit weights (`reinforce`). Either way the
batch normaliser is the mini-batch-global mean of the weights, a `MiniBatchStatistic` the engine sums
before the first backward (`actor_loss_stats`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional, Tuple

import torch

from ballast.engine.losses import GlobalNorm, agg_loss
from ballast.trainer.algorithms.kl import kl_penalty
from ballast.trainer.algorithms.rollout_correction import (RolloutCorrection, correct, is_weights, normalise,
                                                           normaliser, normaliser_sums)

PolicyLossFn = Callable[..., Tuple[torch.Tensor, Dict[str, torch.Tensor]]]
POLICY_LOSSES: Dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


@dataclass(frozen=True)
class ActorLossConfig:
    loss_mode: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None  # seq-mean-token-sum-norm's horizon (None: response width)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    rollout_correction: Optional[RolloutCorrection] = None  # None: no correction in the loss


@register_policy_loss("vanilla")
def vanilla_policy_loss(*, log_prob, old_log_prob, advantages, response_mask, norm, cfg: ActorLossConfig,
                        rollout_is_weights=None):
    """PPO clipped surrogate with asymmetric clip range and dual clip for negative advantages.

    ratio = exp(logp - old_logp); per token
        l = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
    and for A < 0 additionally l = min(l, -A * clip_ratio_c) (dual clip, Ye et al. 2020).
    """
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    surrogate = torch.maximum(unclipped, clipped)
    dual = torch.minimum(surrogate, -advantages * cfg.clip_ratio_c)
    per_token = torch.where(advantages < 0, dual, surrogate)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights
    mode = cfg.loss_agg_mode
    metrics = {
        "actor/pg_clipfrac": agg_loss((clipped > unclipped).float(), response_mask, "token-mean", norm),
        "actor/pg_clipfrac_lower": agg_loss(((surrogate > dual) & (advantages < 0)).float(), response_mask,
                                            "token-mean", norm),
        "actor/ppo_kl": agg_loss(-log_ratio, response_mask, "token-mean", norm),
    }
    return agg_loss(per_token, response_mask, mode, norm, cfg.loss_scale_factor), metrics


@register_policy_loss("gspo")
def gspo_policy_loss(*, log_prob, old_log_prob, advantages, response_mask, norm, cfg: ActorLossConfig,
                     rollout_is_weights=None):
    """GSPO (Zheng et al. 2025): the clipped surrogate with the sequence-level ratio
    s_i = exp(mean_t(logp - old_logp)) on every token, its gradient flowing through each token's logp
    (log s_i,t = sg[log s_i] + logp - sg[logp], capped at 10). No dual clip."""
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = (log_ratio * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1)
    log_seq_ratio = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(log_seq_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights
    metrics = {
        "actor/pg_clipfrac": agg_loss((clipped > unclipped).float(), response_mask, "token-mean", norm),
        "actor/pg_clipfrac_lower": torch.zeros(()),
        "actor/ppo_kl": agg_loss(-log_ratio, response_mask, "token-mean", norm),
    }
    return agg_loss(per_token, response_mask, cfg.loss_agg_mode, norm, cfg.loss_scale_factor), metrics


@register_policy_loss("gpg")
def gpg_policy_loss(*, log_prob, old_log_prob, advantages, response_mask, norm, cfg: ActorLossConfig,
                    rollout_is_weights=None):
    """GPG (Chu et al. 2025): the plain policy gradient -A * logp, no ratio and no clipping."""
    del old_log_prob
    per_token = -log_prob * advantages
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights
    return agg_loss(per_token, response_mask, cfg.loss_agg_mode, norm, cfg.loss_scale_factor), {}


@register_policy_loss("geo_mean")
def geo_mean_policy_loss(*, log_prob, old_log_prob, advantages, response_mask, norm, cfg: ActorLossConfig,
                         rollout_is_weights=None):
    """GMPO (Zhao et al. 2025): per sequence, -mean_t(A) * exp(mean_t(clipped log-ratio)), where each
    token's log-ratio is clipped to [-eps_low, eps_high] on the side its advantage sign makes pessimistic;
    averaged over the sequences of the mini-batch (loss_agg_mode does not apply, as in verl). Rollout
    IS weights enter per sequence as their geometric mean over its tokens (verl's choice)."""
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -cfg.clip_ratio_low, cfg.clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = response_mask.sum(-1)
    seq_ratio = torch.exp((pessimistic * response_mask).sum(-1) / (lengths + 1e-8))
    seq_adv = (advantages * response_mask).sum(-1) / (lengths + 1e-8)
    per_seq = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        per_seq = per_seq * torch.exp((torch.log(rollout_is_weights + 1e-10) * response_mask).sum(-1) / (lengths + 1e-8))
    # Each sequence's share of the mini-batch mean over sequences.
    loss = per_seq.sum() / max(norm.num_sequences, 1)
    was_clipped = (log_ratio != clamped).float()
    metrics = {
        "actor/pg_clipfrac": agg_loss(was_clipped * (advantages > 0), response_mask, "token-mean", norm),
        "actor/pg_clipfrac_lower": agg_loss(was_clipped * (advantages < 0), response_mask, "token-mean", norm),
        "actor/ppo_kl": agg_loss(-log_ratio, response_mask, "token-mean", norm),
    }
    return loss, metrics


def reinforce_policy_loss(*, log_prob, rollout_log_prob, advantages, response_mask, norm, cfg: ActorLossConfig,
                          rollout_is_weights=None):
    """Bypass mode's REINFORCE: -A * w * logp with detached weights w (pi_theta / pi_rollout, truncated
    or IcePop-zeroed) or none; no ratio, no clipping. `actor/ppo_kl` is the token mean of
    log pi_rollout - log pi_theta."""
    per_token = -advantages * log_prob
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights
    metrics = {"actor/ppo_kl": agg_loss(rollout_log_prob - log_prob.detach(), response_mask, "token-mean", norm)}
    return agg_loss(per_token, response_mask, cfg.loss_agg_mode, norm, cfg.loss_scale_factor), metrics


@dataclass(frozen=True)
class ISNormaliser:
    """The batch normaliser of the rollout IS weights as a `MiniBatchStatistic`: per row (numerator,
    count) terms summed over the whole mini-batch. Decoupled mode reads the terms the driver stored
    with the weights; bypass mode computes them from the current log-probs against the rollout's (a
    forward-only pass)."""

    corr: RolloutCorrection
    keys: Tuple[str, str] = ("rollout_is_norm_sum", "rollout_is_norm_count")

    @property
    def needs_outputs(self) -> bool:
        return self.corr.bypass_mode

    def __call__(self, outputs, micro):
        if not self.corr.bypass_mode:
            return tuple(micro[key].to(torch.float64).sum() for key in self.keys)
        log_prob = outputs["log_probs"]
        mask = micro["response_mask"]
        weights = is_weights(log_prob - micro["rollout_log_probs"].to(log_prob.dtype), mask, self.corr).weights
        return tuple(normaliser_sums(weights, mask, self.corr.rollout_is))

    def mean(self, norm) -> float:
        missing = [k for k in self.keys if k not in norm.stats]
        if missing:
            raise RuntimeError(f"the loss needs the mini-batch sums {missing}, but the engine did not compute them: "
                               "call the loss through TrainEngine.forward_backward_batch with its mini_batch_statistic")
        return normaliser(torch.tensor([norm.stats[k] for k in self.keys]), self.corr.rollout_is)


def actor_loss_stats(cfg: ActorLossConfig) -> Optional[ISNormaliser]:
    """The mini-batch statistic the actor loss needs (the IS batch normaliser), or None."""
    corr = cfg.rollout_correction
    return ISNormaliser(corr) if corr is not None and corr.normalises_in_loss else None


def _normalised(weights: torch.Tensor, norm, cfg: ActorLossConfig) -> torch.Tensor:
    stat = actor_loss_stats(cfg)
    return weights if stat is None else normalise(weights, stat.mean(norm))


def bypass_policy_loss(*, log_prob, rollout_log_prob, advantages, response_mask, norm, cfg: ActorLossConfig):
    """Bypass mode: weights and rejection from the current log-probs against the rollout's (per row,
    so any cut gives the same), then PPO-clip against the rollout policy or REINFORCE with weights."""
    corr = cfg.rollout_correction
    rollout_log_prob = rollout_log_prob.to(log_prob.dtype)
    # PPO-clip's ratio already corrects: verl computes its IS weights for metrics only (logged by the driver).
    c = correct(log_prob.detach(), rollout_log_prob, response_mask,
                corr if corr.weights_in_loss else replace(corr, rollout_is=None))
    if corr.loss_type == "reinforce":
        weights = None if c.weights is None else _normalised(c.weights.weights, norm, cfg)
        return reinforce_policy_loss(log_prob=log_prob, rollout_log_prob=rollout_log_prob, advantages=advantages,
                                     response_mask=c.mask, norm=norm, cfg=cfg, rollout_is_weights=weights)
    return vanilla_policy_loss(log_prob=log_prob, old_log_prob=rollout_log_prob, advantages=advantages,
                               response_mask=c.mask, norm=norm, cfg=cfg)


def actor_loss(outputs: Dict[str, torch.Tensor], micro, norm, *, cfg: ActorLossConfig):
    """pg_loss - entropy_coeff * entropy + kl_loss_coef * kl(policy || ref), all globally aggregated."""
    log_prob = outputs["log_probs"]
    mask = micro["response_mask"].to(log_prob.dtype)
    corr = cfg.rollout_correction
    if corr is not None and corr.bypass_mode:
        # the rollout's log-probs are the old policy here, read from the column that holds them
        pg_loss, metrics = bypass_policy_loss(log_prob=log_prob, rollout_log_prob=micro["rollout_log_probs"],
                                              advantages=micro["advantages"], response_mask=mask, norm=norm, cfg=cfg)
    else:
        weights = None
        if corr is not None and "rollout_is_weights" in micro.keys():
            weights = _normalised(micro["rollout_is_weights"].to(log_prob.dtype), norm, cfg)
        pg_loss, metrics = POLICY_LOSSES[cfg.loss_mode](
            log_prob=log_prob, old_log_prob=micro["old_log_probs"], advantages=micro["advantages"],
            response_mask=mask, norm=norm, cfg=cfg, rollout_is_weights=weights,
        )
    loss = pg_loss
    metrics["actor/pg_loss"] = pg_loss.detach()
    if "entropy" in outputs:
        entropy = agg_loss(outputs["entropy"], mask, cfg.loss_agg_mode, norm, cfg.loss_scale_factor)
        metrics["actor/entropy_loss"] = entropy.detach()  # verl's name; actor/entropy is the old-log-prob pass's
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * entropy
    if cfg.use_kl_loss:
        kld = kl_penalty(log_prob, micro["ref_log_prob"], cfg.kl_loss_type)
        kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode, norm, cfg.loss_scale_factor)
        metrics["actor/kl_loss"] = kl_loss.detach()
        loss = loss + cfg.kl_loss_coef * kl_loss
    return loss, {k: v.detach() if torch.is_tensor(v) else v for k, v in metrics.items()}


def make_actor_loss(cfg: ActorLossConfig) -> Callable:
    """The actor loss the workers run: `actor_loss` bound to `cfg`, carrying the mini-batch statistic
    it needs (the engine looks for `mini_batch_statistic`)."""
    fn = functools.partial(actor_loss, cfg=cfg)
    stat = actor_loss_stats(cfg)
    if stat is not None:
        fn.mini_batch_statistic = stat
    return fn


def entropy_metric(entropy: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str,
                   loss_scale_factor: Optional[float] = None) -> float:
    """`actor/entropy`: the per-token entropy of a whole step's responses, aggregated as the actor loss
    is (`loss_agg_mode`, `loss_scale_factor`), verl's definition. As verl computes it over the whole
    batch, sequences without a response token are left out of the sequence count."""
    mask = response_mask.to(entropy.dtype)
    norm = GlobalNorm(num_tokens=int(mask.sum()), num_sequences=int((mask.sum(-1) > 0).sum()),
                      response_len=int(mask.shape[-1]))
    return float(agg_loss(entropy, mask, loss_agg_mode, norm, loss_scale_factor))


def actor_constant_metrics(cfg: ActorLossConfig) -> Dict[str, float]:
    """Metrics that are constants of the config, logged by the driver.

    The engine sums what a loss returns over micro-batches and DP ranks (every loss metric is a
    share), so a constant returned by the loss would be logged multiplied by the micro-batch count.
    """
    return {"actor/kl_coef": cfg.kl_loss_coef} if cfg.use_kl_loss else {}


@dataclass(frozen=True)
class CriticLossConfig:
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None


def critic_loss(outputs: Dict[str, torch.Tensor], micro, norm, *, cfg: CriticLossConfig):
    """Clipped value loss: 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)."""
    values, old_values, returns = outputs["values"], micro["values"], micro["returns"]
    mask = micro["response_mask"].to(values.dtype)
    # clamp(v, lo, hi) returns v itself inside the range; old + clamp(v - old) would round it and
    # count unclipped tokens as clipped in vf_clipfrac.
    clipped = torch.clamp(values, old_values - cfg.cliprange_value, old_values + cfg.cliprange_value)
    loss_unclipped = (values - returns).square()
    loss_clipped = (clipped - returns).square()
    per_token = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    loss = agg_loss(per_token, mask, cfg.loss_agg_mode, norm, cfg.loss_scale_factor)
    metrics = {
        "critic/vf_loss": loss.detach(),
        "critic/vf_clipfrac": agg_loss((loss_clipped > loss_unclipped).float(), mask, "token-mean", norm).detach(),
        "critic/vpred_mean": agg_loss(values.detach(), mask, "token-mean", norm),
    }
    return loss, metrics
