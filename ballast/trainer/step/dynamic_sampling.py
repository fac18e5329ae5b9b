"""DAPO's dynamic sampling (`algorithm.filter_groups`): drop prompt groups whose answers all scored
the same, and generate more prompts until a full training batch of informative groups is collected.

A group whose n answers share one value of the filter metric has zero GRPO advantage everywhere and
only dilutes the batch. The metric is, as in verl, `reward` (alias `seq_reward`: the summed rule
score before any KL penalty) or any numeric value the score function returns (`acc`, `score`, ...).

`GroupCollector` is one step's accumulation: the informative groups of each generation batch are
kept (whole groups, in order) until `data.train_batch_size` of them are there; the step trains on
the first train_batch_size x n rows. Generation batches are padded to their own longest prompt, so
the kept rows are widened to common widths before they are stacked (`concat_padded`). Each batch
is added with the weight version that generated it, so a step whose batches come from different
versions (off-policy overlap: the first generated ahead, the rest with the latest weights) knows
each row's age (`row_versions`).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np
import torch

from ballast.protocol import Batch, concat_padded

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


class DynamicSamplingError(RuntimeError):
    """algorithm.filter_groups could not fill a training batch within max_num_gen_batches."""


class GroupCollector:
    """The informative prompt groups of one step's generation batches (see the module docstring)."""

    def __init__(self, metric: str, train_batch_size: int, n: int, max_num_gen_batches: int, pad_token_id: int):
        self.metric, self.train_batch_size, self.n = metric, train_batch_size, n
        self.max_num_gen_batches, self.pad_token_id = max_num_gen_batches, pad_token_id
        self.num_gen_batches = self.num_groups = self.evicted_groups = 0
        self._kept: List[Tuple[Batch, Dict[str, np.ndarray]]] = []
        self._versions: List[np.ndarray] = []

    @property
    def full(self) -> bool:
        return self.num_groups >= self.train_batch_size

    def state(self) -> dict:
        """Everything the collector holds, as plain values, Batches and arrays (`ballast.protocol.storage`
        stores it in a checkpoint); `from_state` rebuilds it."""
        return {"settings": [self.metric, self.train_batch_size, self.n, self.max_num_gen_batches, self.pad_token_id],
                "counts": [self.num_gen_batches, self.num_groups, self.evicted_groups],
                "kept": [[batch, dict(extras)] for batch, extras in self._kept], "versions": list(self._versions)}

    @classmethod
    def from_state(cls, state: dict) -> "GroupCollector":
        collector = cls(*state["settings"])
        collector.num_gen_batches, collector.num_groups, collector.evicted_groups = state["counts"]
        collector._kept = [(batch, extras) for batch, extras in state["kept"]]
        collector._versions = list(state["versions"])
        return collector

    def add(self, batch: Batch, extras: Mapping[str, np.ndarray], version: int = 0) -> bool:
        """Keep the informative groups of a scored generation batch, generated by weight version
        `version`; True once the step is full.

        Raises DynamicSamplingError when max_num_gen_batches (> 0) batches left it short."""
        self.num_gen_batches += 1
        uids = batch["uid"]
        keep = informative_groups(uids, filter_metric_values(self.metric, batch["token_level_scores"], extras))
        kept_groups = count_groups(uids[keep])
        self.evicted_groups += count_groups(uids) - kept_groups
        self.num_groups += kept_groups
        self._kept.append((batch[np.flatnonzero(keep)], {k: np.asarray(v)[keep] for k, v in extras.items()}))
        self._versions.append(np.full(int(keep.sum()), int(version), dtype=np.int64))
        if self.full:
            return True
        if 0 < self.max_num_gen_batches <= self.num_gen_batches:
            raise DynamicSamplingError(
                f"algorithm.filter_groups: {self.num_gen_batches} generation batches (max_num_gen_batches="
                f"{self.max_num_gen_batches}) gave only {self.progress()} whose answers differ in {self.metric!r}"
            )
        return False

    def progress(self) -> str:
        return f"{self.num_groups} of data.train_batch_size={self.train_batch_size} prompt groups"

    def result(self) -> Tuple[Batch, Dict[str, np.ndarray], Dict[str, float]]:
        """(the step's batch: train_batch_size x n rows, their score-function values, the sampling metrics)."""
        assert self.full, "result() before the step was full"
        batches = [b for b, _ in self._kept]
        batch = concat_padded(batches, self.pad_token_id) if len(batches) > 1 else batches[0]
        size = self.train_batch_size * self.n
        # a value the score function returned for some generation batches only has no row for every sample
        keys = set.intersection(*(set(e) for _, e in self._kept))
        extras = {k: np.concatenate([e[k] for _, e in self._kept])[:size] for k in sorted(keys)}
        metrics = sampling_metrics(self.num_gen_batches, self.evicted_groups,
                                   self.num_groups - self.train_batch_size)
        return batch[:size], extras, metrics

    def row_versions(self) -> np.ndarray:
        """The weight version that generated each row of `result()`'s batch."""
        assert self.full, "row_versions() before the step was full"
        return np.concatenate(self._versions)[: self.train_batch_size * self.n]
