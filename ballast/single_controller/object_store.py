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

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import List, Optional, Tuple

import ray
import torch

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class StoredWeights:
    """What a rollout worker needs to load a weight version: the bucket references, in order, and the
    weight-sync probe with the trainer's log-probs on it (None when the check is off)."""

    buckets: Tuple[ray.ObjectRef, ...]
    num_tensors: int
    num_bytes: int
    version: int
    probe_tokens: Optional[Tuple[int, ...]] = None
    probe_log_probs: Optional[torch.Tensor] = None
    trainer_dtype: str = "float32"


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
