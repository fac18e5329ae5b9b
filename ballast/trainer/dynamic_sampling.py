"""DAPO's dynamic sampling (`algorithm.filter_groups`): drop prompt groups whose answers all scored
the same, and generate more prompts until a full training batch of informative groups is collected.

A group whose n answers share one value of the filter metric has zero GRPO advantage everywhere and
only dilutes the batch. The metric is, as in verl, `reward` (alias `seq_reward`: the summed rule
score before any KL penalty) or any numeric value the score function returns (`acc`, `score`, ...).
"""

from __future__ import annotations

from typing import Dict, Mapping, Sequence

import numpy as np
import torch

SCORE_METRICS = ("reward", "seq_reward", "seq_final_reward")


def filter_metric_values(metric: str, token_level_scores: torch.Tensor, extras: Mapping[str, np.ndarray]) -> np.ndarray:
    """Per-sample value of `metric` (one of SCORE_METRICS or a key the score function returns)."""
    if metric in SCORE_METRICS:
        return token_level_scores.sum(-1).double().numpy()
    if metric not in extras:
        raise ValueError(
            f"algorithm.filter_groups.metric={metric!r} is neither one of {SCORE_METRICS} nor a value the score "
            f"function returns (it returns {sorted(extras)})"
        )
    return np.asarray(extras[metric], dtype=np.float64)


def informative_groups(uids: Sequence, values: np.ndarray) -> np.ndarray:
    """Boolean per sample: its group has one sample or a non-zero spread of `values` (verl: std > 0)."""
    uids = np.asarray(uids).astype(str)
    keep = np.ones(len(uids), dtype=bool)
    for uid in np.unique(uids):
        rows = np.flatnonzero(uids == uid)
        if len(rows) > 1 and float(np.std(values[rows])) == 0.0:
            keep[rows] = False
    return keep


def count_groups(uids: Sequence) -> int:
    return len(np.unique(np.asarray(uids).astype(str)))


def sampling_metrics(num_gen_batches: int, evicted_groups: int, surplus_groups: int) -> Dict[str, float]:
    """verl's `training/filter_groups/*` counters and the DAPO recipe's `train/num_gen_batches`.

    Both verl counters count prompt GROUPS (uids), despite "samples" in their names: `evicted_samples`
    the groups dropped for a single shared metric value, `discarded_surplus_samples` the informative
    groups collected beyond `data.train_batch_size` and not trained on.
    """
    return {"train/num_gen_batches": float(num_gen_batches),
            "training/filter_groups/evicted_samples": float(evicted_groups),
            "training/filter_groups/discarded_surplus_samples": float(surplus_groups)}
