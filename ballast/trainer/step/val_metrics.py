"""Validation metrics with verl's names: `val-core/<source>/<var>/mean@n`, `best@k`, `worst@k`, `maj@k`.

Every validation prompt is answered n = `rollout.val_kwargs.n` times. Per prompt and per variable
(`reward` plus every numeric value the score function returns; `acc` is the core variable when
present), the n answers give mean@n and std@n and, for k = 2, 4, ..., n, bootstrap estimates (1000
draws of k answers with replacement, seed 42) of the best, the worst and the majority-vote value
(`maj` needs a `pred` value per answer); these are averaged over the prompts of each data source.
Names and numbers follow verl's `process_validation_metrics` (parity-tested), so dashboards carry
over: the core variable's mean/best/maj at the largest k go under `val-core/`, the rest under `val-aux/`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Dict, List, Mapping, Sequence

import numpy as np

BOOTSTRAP_DRAWS = 1000
BOOTSTRAP_SEED = 42


def _subset_sizes(n: int) -> List[int]:
    """2, 4, 8, ... below n, then n itself (none for n <= 1)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def _majority_value(values: np.ndarray, preds: np.ndarray) -> float:
    """The value of the first answer whose prediction is the most frequent (ties: first seen)."""
    counts = Counter(preds.tolist())
    best = max(counts, key=counts.get)
    return float(values[preds.tolist().index(best)])


def _bootstrap(values: np.ndarray, preds, k: int) -> Dict[str, float]:
    # The same draws as verl: a fresh legacy RandomState(42) per (prompt, variable, k).
    idx = np.random.RandomState(BOOTSTRAP_SEED).choice(len(values), size=(BOOTSTRAP_DRAWS, k), replace=True)
    drawn = values[idx]
    out = {}
    for name, per_draw in (("best", drawn.max(axis=1)), ("worst", drawn.min(axis=1))):
        out[f"{name}@{k}/mean"], out[f"{name}@{k}/std"] = float(per_draw.mean()), float(per_draw.std())
    if preds is not None:
        # A separate RandomState(42) stream, as verl draws the majority-vote subsets anew.
        idx = np.random.RandomState(BOOTSTRAP_SEED).choice(len(values), size=(BOOTSTRAP_DRAWS, k), replace=True)
        maj = np.array([_majority_value(values[row], preds[row]) for row in idx])
        out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = float(maj.mean()), float(maj.std())
    return out


def _per_prompt(values: np.ndarray, preds) -> Dict[str, float]:
    n = len(values)
    metrics = {f"mean@{n}": float(values.mean())}
    if n > 1:
        metrics[f"std@{n}"] = float(values.std())
        for k in _subset_sizes(n):
            metrics.update(_bootstrap(values, preds, k))
    return metrics


def validation_metrics(data_sources: Sequence[str], uids: Sequence[str],
                       infos: Mapping[str, Sequence]) -> Dict[str, float]:
    """`val-core/...` and `val-aux/...` from per-answer values (`infos[var][i]` for answer i)."""
    grouped: Dict[str, Dict[str, Dict[str, list]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, (source, uid) in enumerate(zip(data_sources, uids)):
        for var, values in infos.items():
            grouped[str(source)][str(uid)][var].append(values[i])
    per_source: Dict[str, Dict[str, Dict[str, list]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for source, by_uid in grouped.items():
        for by_var in by_uid.values():
            preds = by_var.get("pred")
            for var, raw in by_var.items():
                values = [v for v in raw if v is not None]
                if not values or isinstance(values[0], str):
                    continue
                usable_preds = (np.array(preds, dtype=object) if preds is not None and len(preds) == len(values)
                                and all(p is not None for p in preds) else None)
                for name, value in _per_prompt(np.asarray(values, dtype=np.float64), usable_preds).items():
                    per_source[source][var][name].append(value)
    metrics: Dict[str, float] = {}
    for source, by_var in per_source.items():
        core = "acc" if "acc" in by_var else "reward"
        for var, by_name in by_var.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in by_name)
            for name, values in by_name.items():
                is_core = var == core and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                metrics[f"{'val-core' if is_core else 'val-aux'}/{source}/{var}/{name}"] = float(np.mean(values))
    return metrics
