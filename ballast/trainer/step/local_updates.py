"""A step's local PPO updates (verl's `trainer.v1.separate_async.parameter_sync_step`): which rows each
one trains, and how their metrics make the step's.

With P local updates a step's batch is cut into P shares of whole prompt groups, in generation order;
each share goes through its own plans, values, advantages, critic and actor update (the driver's
`RayPPOTrainer.local_update`), so a GRPO group, a GAE return or a batch-level normalisation never
mixes rows of two updates. P = 1 is the ordinary step: one share, the whole batch.

Each update reports its own metrics; the step logs one row, so they are merged by what they measure:
a learning rate or a running count is the last update's, a maximum the largest and a minimum the
smallest, a micro-batch count the total, anything else the mean weighted by the update's samples.
The step's data metrics (scores, lengths, advantages) are computed over the whole batch afterwards.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np


def share_rows(uids: Sequence, num_shares: int) -> List[np.ndarray]:
    """Row indices of each of `num_shares` local updates: equal runs of consecutive rows, none splitting
    a prompt group (rows with one `uid`), in order. A cut through a group is a ValueError."""
    uids = np.asarray(uids)
    rows = len(uids)
    if num_shares < 1 or rows % num_shares:
        raise ValueError(f"{rows} rows cannot be cut into {num_shares} equal local updates")
    size = rows // num_shares
    shares = [np.arange(start, start + size) for start in range(0, rows, size)]
    for left, right in zip(shares, shares[1:]):
        if uids[left[-1]] == uids[right[0]]:
            raise ValueError(f"the cut between local updates at row {right[0]} splits prompt group {str(uids[right[0]])!r}")
    seen = [set(map(str, uids[s].tolist())) for s in shares]
    for i, group in enumerate(seen[1:], 1):
        shared = group & set().union(*seen[:i])
        if shared:
            raise ValueError(f"prompt group {sorted(shared)[0]!r} has rows in two local updates (its rows are not adjacent)")
    return shares


def _merge_rule(key: str) -> str:
    name = key.rsplit("/", 1)[-1]
    if name == "lr" or name.endswith("_total") or name == "global_step":
        return "last"
    if name.startswith("num_"):
        return "sum"
    if name == "minmax_diff":
        return "max"
    if name.startswith("max") or name.endswith("max"):
        return "max"
    if name.startswith("min") or name.endswith("min"):
        return "min"
    return "mean"


def merge_local_metrics(per_update: Sequence[Dict[str, float]], samples: Sequence[int]) -> Dict[str, float]:
    """One step's metrics from its local updates' (module docstring); `samples[i]`: rows of update i."""
    if len(per_update) == 1:
        return dict(per_update[0])
    merged: Dict[str, float] = {}
    keys = list(dict.fromkeys(k for metrics in per_update for k in metrics))
    for key in keys:
        pairs = [(m[key], n) for m, n in zip(per_update, samples, strict=True) if key in m]
        values = [float(v) for v, _ in pairs]
        rule = _merge_rule(key)
        if rule == "last":
            merged[key] = values[-1]
        elif rule == "sum":
            merged[key] = float(sum(values))
        elif rule == "max":
            merged[key] = max(values)
        elif rule == "min":
            merged[key] = min(values)
        else:
            weights = np.asarray([n for _, n in pairs], dtype=np.float64)
            merged[key] = float(np.dot(values, weights) / weights.sum()) if weights.sum() > 0 else float(np.mean(values))
    return merged
