"""A resumable prompt dataloader: seeded shuffling per epoch, and a state (epoch, position, seed)
that lets a restarted run continue with exactly the batches an uninterrupted run would have seen.

Position counts samples *handed to the caller*, not indices fetched by worker processes: a torch
DataLoader with workers prefetches `num_workers * prefetch_factor` batches ahead, so the sampler's
own progress overstates what training has consumed. The wrapper therefore counts yielded batches
and rebuilds the sampler's starting point from that count on every new iteration.

Knobs (verl's ``data.dataloader_num_workers``, ``data.prefetch_factor``, ``data.persistent_workers``):
with ``num_workers=0`` batches are built in the calling process on demand, so ``prefetch_factor``
(batches prefetched per worker) and ``persistent_workers`` (keep workers alive across epochs) have no
meaning; torch rejects them there and so does this class, with an explanation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from ballast.data.errors import SettingError


class ResumableSampler(torch.utils.data.Sampler):
    """Sample indices of one epoch, starting at `start`; the epoch's order depends only on
    (seed, epoch), so any position of any epoch can be reproduced."""

    def __init__(self, num_samples: int, *, shuffle: bool = True, seed: int = 0):
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start = 0

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_order(self.epoch)[self.start :].tolist())

    def __len__(self) -> int:
        return self.num_samples - self.start


class StatefulDataLoader:
    """Batches of a map-style dataset in seeded per-epoch order, resumable at the exact sample.

    Iterating yields the rest of the current epoch, then advances to the next epoch; breaking out
    early keeps the position, so the next iteration (or a loader restored from `state_dict()`)
    continues with the next unseen batch.
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
    ):
        check_loader_knobs(batch_size, num_workers, prefetch_factor, persistent_workers)
        num_samples = len(dataset)
        if drop_last and num_samples < batch_size:
            raise ValueError(
                f"dataset has {num_samples} samples < batch_size={batch_size} with drop_last=True: "
                "an epoch would have no batch (lower the batch size, e.g. data.train_batch_size, or add data)"
            )
        if num_samples == 0:
            raise ValueError("dataset is empty")
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # samples of the current epoch already yielded
        self._sampler = ResumableSampler(num_samples, shuffle=shuffle, seed=seed)
        self._loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self._sampler,
            drop_last=drop_last,
            collate_fn=collate_fn,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
        )

    @property
    def num_samples(self) -> int:
        return self._sampler.num_samples

    @property
    def seed(self) -> int:
        return self._sampler.seed

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator:
        self._sampler.epoch, self._sampler.start = self.epoch, self.position
        for batch in self._loader:
            self.position += min(self.batch_size, self.num_samples - self.position)
            yield batch
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self._sampler.seed,
            "shuffle": self._sampler.shuffle,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by `state_dict` (the seed too, so the order is the saved one)."""
        missing = sorted({"epoch", "position", "seed"} - set(state))
        if missing:
            raise ValueError(f"dataloader state is missing keys {missing}")
        saved_n = state.get("num_samples", self.num_samples)
        if saved_n != self.num_samples:
            raise ValueError(
                f"dataloader state was saved for {saved_n} samples but the dataset has {self.num_samples}: "
                "the data or its filtering changed, so the saved position is meaningless"
            )
        if not 0 <= state["position"] <= self.num_samples or state["epoch"] < 0:
            raise ValueError(
                f"dataloader state out of range: epoch={state['epoch']}, position={state['position']} "
                f"(num_samples={self.num_samples})"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._sampler.seed = int(state["seed"])
        self._sampler.shuffle = bool(state.get("shuffle", self._sampler.shuffle))


def check_loader_knobs(batch_size, num_workers, prefetch_factor, persistent_workers) -> None:
    """The loader's rules on its settings (the trainer also calls this at start-up, before reading data)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise SettingError("batch_size", f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"data.dataloader_num_workers must be an int >= 0, got {num_workers!r}")
    if prefetch_factor is not None:
        if not isinstance(prefetch_factor, int) or prefetch_factor < 1:
            raise ValueError(f"data.prefetch_factor must be a positive int or None, got {prefetch_factor!r}")
        if num_workers == 0:
            raise ValueError(
                f"data.prefetch_factor={prefetch_factor} needs data.dataloader_num_workers > 0: it is the number "
                "of batches each worker process loads ahead, and with 0 workers batches are built on demand in "
                "the main process; set prefetch_factor to null or use workers"
            )
    if persistent_workers and num_workers == 0:
        raise ValueError(
            "data.persistent_workers=True needs data.dataloader_num_workers > 0: it keeps worker processes "
            "alive between epochs, and with 0 workers there are none"
        )
