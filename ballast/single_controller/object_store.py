"""Weights between worker groups through Ray's object store, in buckets.

With split resource pools (`trainer.v1.trainer_mode=separate_async`) the rollout workers are other
processes, often on other nodes, than the trainer's, so the actor's weights cannot be handed over in
memory. The trainer's rank 0 packs the gathered (name, full tensor) pairs into buckets of about
`bucket_bytes`, puts each into the object store as soon as it is full, and returns only the
references; each rollout worker fetches them one at a time and streams them into its engine. At no
point does a process hold more than one bucket beyond what it already has, and the tensors never pass
through the driver, which only forwards the references.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import ray
import torch

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class StoredWeights:
    """What a rollout worker needs to load a weight version: the bucket references, in order, and the
    weight-sync probe with the trainer's log-probs on it, of these weights and of the model directory's
    (`start_log_probs`, what the rollout engine serves before its first load; None when the check is off)."""

    buckets: Tuple[ray.ObjectRef, ...]
    num_tensors: int
    num_bytes: int
    version: int
    probe_tokens: Optional[Tuple[int, ...]] = None
    probe_log_probs: Optional[torch.Tensor] = None
    trainer_dtype: str = "float32"
    start_log_probs: Optional[torch.Tensor] = None


def put_buckets(named_tensors: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                dtype: Optional[torch.dtype] = None) -> Tuple[List[ray.ObjectRef], int, int]:
    """Put (name, tensor) pairs into the object store in buckets of at least `bucket_bytes` (the last may
    be smaller; a tensor larger than a bucket gets one of its own), floating-point tensors cast to
    `dtype` when given. Returns (references, tensors, bytes). Tensors are copied to contiguous CPU
    memory first: the caller's may be views of live parameters."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    refs: List[ray.ObjectRef] = []
    bucket: List[Tuple[str, torch.Tensor]] = []
    size = count = total = 0
    for name, tensor in named_tensors:
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        cpu = tensor.detach().to("cpu", dtype=cast, copy=True).contiguous()
        bucket.append((name, cpu))
        nbytes = cpu.numel() * cpu.element_size()
        size, count, total = size + nbytes, count + 1, total + nbytes
        if size >= bucket_bytes:
            refs.append(ray.put(bucket))
            bucket, size = [], 0
    if bucket:
        refs.append(ray.put(bucket))
    return refs, count, total


def iter_buckets(refs: Sequence[ray.ObjectRef]) -> Iterator[Tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of `refs`, fetching one bucket at a time (the previous one is released
    before the next is fetched)."""
    for ref in refs:
        bucket = ray.get(ref)
        yield from bucket
        del bucket


@ray.remote(num_cpus=0)
class WeightMailbox:
    """The newest exported weights, where rollout workers look for them during a generation (partial
    rollouts: `trainer.ballast_overlap.partial_rollout`). The driver posts every export; a worker
    asks for anything newer than what it serves. Only the newest export is kept (its buckets stay in
    the object store while referenced here or by a worker loading them), and, for a TP group's
    followers, the export its leader switches to (`hold`, `take`): by the time they ask, a newer one
    may have been posted."""

    def __init__(self) -> None:
        self._latest: Optional[StoredWeights] = None
        self._held: Dict[int, Tuple[StoredWeights, int]] = {}  # version -> (export, takes still to come)

    def post(self, weights: StoredWeights) -> None:
        if self._latest is None or weights.version > self._latest.version:
            self._latest = weights

    def newer_than(self, version: int) -> Optional[StoredWeights]:
        latest = self._latest
        return latest if latest is not None and latest.version > version else None

    def hold(self, weights: StoredWeights, takers: int) -> int:
        """Keep `weights` until `takers` more `take`s of them; returns the key to take them by. The
        export comes back from the worker that got it (an actor-call argument, so that Ray counts this
        actor as a holder of its buckets): the mailbox may have dropped it since. A taker that never
        comes (its rank died mid-call) leaves the export held until the mailbox goes."""
        if takers < 1:
            raise ValueError(f"takers={takers} must be >= 1")
        _, pending = self._held.get(weights.version, (weights, 0))
        self._held[weights.version] = (weights, pending + takers)
        return weights.version

    def take(self, key: int) -> StoredWeights:
        """One take of what `hold` keeps under `key` (the last one lets go of it)."""
        if key not in self._held:
            raise KeyError(f"no held export under key {key} (held: {sorted(self._held)}): every take needs a hold")
        weights, pending = self._held[key]
        if pending > 1:
            self._held[key] = (weights, pending - 1)
        else:
            del self._held[key]
        return weights


class MailboxUpdates:
    """A rollout worker's view of a `WeightMailbox` during one generate call, in the shape the resuming
    engine core asks for (`ballast.workers.rollout.resume.WeightUpdates`). The mailbox is asked at most
    every `poll_interval_s`: an engine step is far shorter than a training step, so a new version is
    seen within one interval of its export at a cost of one small actor call per interval."""

    def __init__(self, mailbox, version: int, load: Callable[[StoredWeights], None], poll_interval_s: float = 0.05):
        self.mailbox, self.version, self._load = mailbox, version, load
        self.poll_interval_s = poll_interval_s
        self._last_poll = float("-inf")
        self.loads = 0

    def newer(self) -> Optional[StoredWeights]:
        now = time.monotonic()
        if now - self._last_poll < self.poll_interval_s:
            return None
        self._last_poll = now
        return ray.get(self.mailbox.newer_than.remote(self.version))

    def load(self, weights: StoredWeights) -> int:
        self._load(weights)
        self.version = weights.version
        self.loads += 1
        return self.version

    def share(self, weights: StoredWeights, takers: int) -> int:
        """A TP leader's side of a switch: leave `weights` at the mailbox for `takers` followers; the key
        they `take` them by. Object references only resolve in a process that got them through Ray, so
        the export cannot travel over the TP group itself."""
        return ray.get(self.mailbox.hold.remote(weights, takers))

    def take(self, key: int) -> StoredWeights:
        """A TP follower's side: the export its leader shared under `key`."""
        return ray.get(self.mailbox.take.remote(key))
