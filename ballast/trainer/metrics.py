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
    mask = batch["response_mask"].bool()
    prompt_lengths = batch["attention_mask"].sum(-1) - batch["response_mask"].sum(-1)
    response_lengths = batch["response_mask"].sum(-1).float()
    metrics: Dict[str, float] = {}
    metrics.update(_stats("critic/score", batch["token_level_scores"].sum(-1)))
    metrics.update(_stats("critic/rewards", batch["token_level_rewards"].sum(-1)))
    metrics.update(_stats("critic/advantages", batch["advantages"][mask]))
    metrics.update(_stats("critic/returns", batch["returns"][mask]))
    if use_critic and "values" in batch:
        metrics.update(_stats("critic/values", batch["values"][mask]))
    metrics.update(_stats("response_length", response_lengths))
    metrics["response_length/clip_ratio"] = float((response_lengths >= max_response_length).float().mean())
    metrics.update(_stats("prompt_length", prompt_lengths.float()))
    return metrics


def throughput_metrics(batch: Batch, step_seconds: float, num_workers: int) -> Dict[str, float]:
    tokens = float(batch["attention_mask"].sum())
    return {
        "perf/total_num_tokens": tokens,
        "perf/throughput_tokens_per_s": tokens / max(step_seconds, 1e-9),
        "perf/throughput_tokens_per_s_per_worker": tokens / max(step_seconds, 1e-9) / num_workers,
    }


def pop_worker_timing(batch: Batch) -> Dict[str, float]:
    """Phase times the workers measured inside a call (`meta["metrics"]["timing_s/<phase>"]`, one value
    per rank), removed from the batch; ranks run concurrently, so the slowest one counts."""
    reported = batch.meta.pop("metrics", None) or {}
    return {key[len("timing_s/"):]: float(max(values)) for key, values in reported.items()
            if key.startswith("timing_s/") and values}


def timing_per_token_metrics(batch: Batch, timing: Dict[str, float]) -> Dict[str, float]:
    """`timing_per_token_ms/<phase>`: milliseconds per token of the tokens each phase processes.

    Generation (and the weight sync that precedes it) per response token, every other phase per
    token of the whole batch (prompts + responses), as verl counts them.
    """
    response_tokens = max(float(batch["response_mask"].sum()), 1.0)
    all_tokens = max(float(batch["attention_mask"].sum()), 1.0)
    out = {}
    for phase, seconds in timing.items():
        if phase == "step":
            continue
        tokens = response_tokens if phase in ("gen", "weight_sync") else all_tokens
        out[f"timing_per_token_ms/{phase}"] = 1000.0 * seconds / tokens
    return out
