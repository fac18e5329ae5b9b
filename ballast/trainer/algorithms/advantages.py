"""Advantage estimators (a registry: GAE, GRPO, RLOO, REINFORCE++ (+ baseline), Pass@k, OPO, GPG), pure
torch on the driver.

All take response-aligned (B, R) tensors and return `(advantages, returns)`, both (B, R) and zero
outside `response_mask`. `index` holds the prompt uid of every sample: the outcome-level estimators
compare the samples of one prompt with each other.

A response's mask-0 positions are not only its right padding: agent loops insert tool and user
tokens between sampled turns, and token-level rejection (rollout correction) masks single tokens.
As in verl, the token-level estimators (GAE, REINFORCE++) step over every mask-0 position: the
running return, the next value and the GAE accumulator pass through it unchanged (no reward, no
discount, no value read there), so a turn before a tool response is credited with the rewards
after it. The outcome-level ones only sum and count, so a mask-0 span changes nothing for them.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

AdvantageFn = Callable[..., Tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: Dict[str, AdvantageFn] = {}
_EPS = 1e-6


def register_adv_estimator(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ADV_ESTIMATORS[name] = fn
        return fn

    return wrap


def get_adv_estimator(name: str) -> AdvantageFn:
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator={name!r} is not one of {sorted(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name]


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise to zero mean / unit variance over the masked entries (unbiased variance)."""
    mask_f = mask.to(values.dtype)
    count = mask_f.sum()
    mean = (values * mask_f).sum() / count.clamp_min(1.0)
    var = (((values - mean) * mask_f) ** 2).sum() / (count - 1).clamp_min(1.0)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask_f


def _group_ids(index: Sequence) -> Tuple[np.ndarray, int]:
    """Dense group ids (0..G-1) for the uids in `index`, in order of first appearance."""
    _, first, inverse = np.unique(np.asarray(index, dtype=object).astype(str), return_index=True, return_inverse=True)
    order = np.argsort(first)  # make ids follow first appearance, so results never depend on uid spelling
    remap = np.empty_like(order)
    remap[order] = np.arange(len(order))
    return remap[inverse], len(order)


def _group_stats(scores: torch.Tensor, index: Sequence) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased group std and group size."""
    gid, num_groups = _group_ids(index)
    gid_t = torch.as_tensor(gid, device=scores.device)
    size = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid_t, torch.ones_like(scores))
    total = torch.zeros_like(size).index_add_(0, gid_t, scores)
    mean = total / size
    sq = torch.zeros_like(size).index_add_(0, gid_t, (scores - mean[gid_t]) ** 2)
    std = torch.sqrt(sq / (size - 1).clamp_min(1.0))
    return mean[gid_t], std[gid_t], size[gid_t]


@register_adv_estimator("grpo")
def grpo_advantage(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
                   norm_adv_by_std_in_grpo: bool = True, **_) -> Tuple[torch.Tensor, torch.Tensor]:
    """Outcome advantage: (score - mean of the prompt's group) [/ group std].

    A group of one has no baseline: as in verl it keeps its raw score (mean 0, std 1).
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, std, size = _group_stats(scores, index)
    mean = torch.where(size > 1, mean, torch.zeros_like(mean))
    std = torch.where(size > 1, std, torch.ones_like(std))
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + _EPS)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_estimator("rloo")
def rloo_advantage(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
                   **_) -> Tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out baseline: score minus the mean of the other samples of the same prompt."""
    scores = token_level_rewards.sum(dim=-1)
    mean, _, size = _group_stats(scores, index)
    loo = torch.where(size > 1, size / (size - 1).clamp_min(1.0) * (scores - mean), scores)
    adv = loo.unsqueeze(-1) * response_mask
    return adv, adv


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_t' on response tokens, t' the next response token of the row (0 after its
    last one). The return crosses mask-0 positions unchanged: their rewards are not added and they
    cost no discount step. Zero outside `mask`."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t].bool(), rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantage(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                  gamma: float = 1.0, **_) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-level discounted returns, whitened over the whole batch."""
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@register_adv_estimator("gae")
def gae_advantage(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                  values: Optional[torch.Tensor] = None, gamma: float = 1.0, lam: float = 1.0,
                  **_) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's response tokens: the TD error of a token uses
    the value of the row's next response token (0 after the last one), and the accumulator steps over
    mask-0 positions unchanged (module docstring)."""
    if values is None:
        raise ValueError("algorithm.adv_estimator=gae needs critic values (the batch has no 'values')")
    mask = response_mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        on = mask[:, t].bool()
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        last = torch.where(on, delta + gamma * lam * last, last)
        next_value = torch.where(on, values[:, t], next_value)
        advantages[:, t] = last
    returns = (advantages + values) * mask
    return masked_whiten(advantages, mask), returns


def _group_baseline_or_zero(scores: torch.Tensor, index: Sequence) -> torch.Tensor:
    """Per-sample group mean; a group of one has no baseline (0), as in verl."""
    mean, _, size = _group_stats(scores, index)
    return torch.where(size > 1, mean, torch.zeros_like(mean))


@register_adv_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                           index: Sequence, **_) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: (score - group mean) on every token, whitened over the batch."""
    scores = token_level_rewards.sum(dim=-1)
    centred = (scores - _group_baseline_or_zero(scores, index)).unsqueeze(-1) * response_mask
    adv = masked_whiten(centred, response_mask)
    return adv, adv


@register_adv_estimator("grpo_passk")
def grpo_passk_advantage(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
                         norm_adv_by_std_in_grpo: bool = True, **_) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pass@k (Chen et al. 2025): only the best sample of a group is credited, with best - second best
    [/ group std]; every other sample gets 0. Groups need at least two samples."""
    scores = token_level_rewards.sum(dim=-1)
    gid, num_groups = _group_ids(index)
    adv = torch.zeros_like(scores)
    for g in range(num_groups):
        rows = torch.as_tensor(np.flatnonzero(gid == g), device=scores.device)
        if rows.numel() < 2:
            raise ValueError(f"algorithm.adv_estimator=grpo_passk needs >= 2 samples per prompt, got {rows.numel()}")
        group = scores[rows]
        top, top_idx = torch.topk(group, 2)
        value = top[0] - top[1]
        if norm_adv_by_std_in_grpo:
            value = value / (torch.std(group) + _EPS)
        adv[rows[top_idx[0]]] = value
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_estimator("opo")
def opo_advantage(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
                  **_) -> Tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): the baseline is the group's length-weighted mean score."""
    scores = token_level_rewards.sum(dim=-1)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    gid, num_groups = _group_ids(index)
    gid_t = torch.as_tensor(gid, device=scores.device)
    weighted = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid_t, lengths * scores)
    total_len = torch.zeros_like(weighted).index_add_(0, gid_t, lengths)
    size = torch.zeros_like(weighted).index_add_(0, gid_t, torch.ones_like(scores))
    baseline = torch.where(size > 1, weighted / total_len.clamp_min(1e-12), torch.zeros_like(weighted))[gid_t]
    adv = (scores - baseline).unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_estimator("gpg")
def gpg_advantage(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
                  **_) -> Tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025): (score - group mean) scaled by batch size / number of non-zero scores."""
    scores = token_level_rewards.sum(dim=-1)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    adv = (alpha * (scores - _group_baseline_or_zero(scores, index))).unsqueeze(-1) * response_mask
    return adv, adv
