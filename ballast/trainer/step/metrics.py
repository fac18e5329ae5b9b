"""Step metrics with verl's names: scores, rewards, advantages, returns, values, lengths, throughput."""

from __future__ import annotations

from typing import Dict

import torch

from ballast.protocol import Batch


def _stats(prefix: str, values: torch.Tensor) -> Dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


def data_metrics(batch: Batch, max_response_length: int, use_critic: bool) -> Dict[str, float]:
    """verl's `compute_data_metrics`: scores and rewards of the samples with a non-empty response,
    token statistics under the response mask, lengths and their clip ratios (prompt clip ratio: the
    share of prompts as wide as the batch's prompt width), and the value function's explained variance."""
    mask = batch["response_mask"].bool()
    response_width = batch["responses"].shape[-1]
    prompt_width = batch["attention_mask"].shape[-1] - response_width
    prompt_lengths = batch["attention_mask"][:, :prompt_width].sum(-1).float()
    response_lengths = batch["attention_mask"][:, prompt_width:].sum(-1).float()
    answered = response_lengths > 0
    metrics: Dict[str, float] = {}
    metrics.update(_stats("critic/score", batch["token_level_scores"].sum(-1)[answered]))
    metrics.update(_stats("critic/rewards", batch["token_level_rewards"].sum(-1)[answered]))
    metrics.update(_stats("critic/advantages", batch["advantages"][mask]))
    returns = batch["returns"][mask]
    metrics.update(_stats("critic/returns", returns))
    if use_critic and "values" in batch:
        values = batch["values"][mask]
        metrics.update(_stats("critic/values", values))
        if values.numel() > 1:
            explained = 1.0 - torch.var(returns - values) / (torch.var(returns) + 1e-5)
            metrics["critic/vf_explained_var"] = float(explained)
    metrics.update(_stats("response_length", response_lengths))
    metrics["response_length/clip_ratio"] = float((response_lengths >= max_response_length).float().mean())
    if answered.any():
        metrics.update(_stats("response_length_non_aborted", response_lengths[answered]))
        metrics["response_length_non_aborted/clip_ratio"] = float(
            (response_lengths[answered] >= max_response_length).float().mean())
    metrics["response/aborted_ratio"] = float((~answered).float().mean())
    metrics.update(_stats("prompt_length", prompt_lengths))
    metrics["prompt_length/clip_ratio"] = float((prompt_lengths == prompt_width).float().mean())
    return metrics


# verl's per-token timing: generation per response token, the training phases per token overall.
_PER_TOKEN_PHASES = {"gen": "response", "ref": "all", "values": "all", "adv": "all", "update_critic": "all",
                     "update_actor": "all"}


def timing_metrics(batch: Batch, timing_s: Dict[str, float]) -> Dict[str, float]:
    """`timing_s/<phase>` and verl's `timing_per_token_ms/<phase>`."""
    response_tokens = float(batch["response_mask"].sum())
    tokens = {"response": response_tokens, "all": float(batch["attention_mask"].sum())}
    metrics = {f"timing_s/{name}": value for name, value in timing_s.items()}
    for name, kind in _PER_TOKEN_PHASES.items():
        if name in timing_s:
            metrics[f"timing_per_token_ms/{name}"] = timing_s[name] * 1000 / tokens[kind] if tokens[kind] else 0.0
    return metrics


def rollout_probs_diff_metrics(batch: Batch, actor_key: str = "old_log_probs") -> Dict[str, float]:
    """verl's rollout-vs-actor check on token probabilities (not log-probs): |p_rollout - p_actor| and
    their Pearson correlation over the response tokens (`actor_key`: the actor's log-probs); empty
    without rollout log-probs."""
    if "rollout_log_probs" not in batch or actor_key not in batch:
        return {}
    mask = batch["response_mask"].bool()
    actor, rollout = batch[actor_key].exp()[mask].double(), batch["rollout_log_probs"].exp()[mask].double()
    if actor.numel() == 0:
        return {}
    diff = (actor - rollout).abs()
    corr = torch.corrcoef(torch.stack([actor, rollout]))[0, 1] if actor.numel() > 1 else torch.tensor(float("nan"))
    return {
        "training/rollout_probs_diff_max": float(diff.max()), "training/rollout_probs_diff_mean": float(diff.mean()),
        "training/rollout_probs_diff_std": float(diff.std()) if diff.numel() > 1 else float("nan"),
        "training/rollout_actor_probs_pearson_corr": float(corr),
    }


def throughput_metrics(batch: Batch, step_seconds: float, num_workers: int) -> Dict[str, float]:
    """verl's perf/total_num_tokens, perf/time_per_step and perf/throughput (tokens per second per
    worker), and the same throughput under Ballast's older, unit-carrying names."""
    tokens = float(batch["attention_mask"].sum())
    return {
        "perf/total_num_tokens": tokens,
        "perf/time_per_step": step_seconds,
        "perf/throughput": tokens / max(step_seconds, 1e-9) / num_workers,
        "perf/throughput_tokens_per_s": tokens / max(step_seconds, 1e-9),
        "perf/throughput_tokens_per_s_per_worker": tokens / max(step_seconds, 1e-9) / num_workers,
    }
