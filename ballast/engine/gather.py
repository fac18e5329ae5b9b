"""Full tensors of FSDP-sharded parameters, gathered in buckets: one collective per bucket.

Weight sync (actor -> rollout engine) needs every parameter whole on every rank.
`DTensor.full_tensor()` issues one all-gather per parameter; on CPU/gloo each is a network round
trip, and a 30-layer model has ~270 of them. Here the local shards of consecutive parameters are
packed into one flat buffer, gathered with a single all-gather (`ballast.engine.dist.all_gather_single`),
and cut back into full tensors. FSDP2 shards dim 0 in rank order with `ceil(dim0 / world)` rows per
rank (the last ranks may hold fewer or none), so padding every local shard to that row count makes the
gathered buffer, read rank by rank, exactly the padded full tensor.

Hybrid sharding (a 2-D ("replicate", "shard") mesh, placements (Replicate(), Shard(0))) gathers over
the shard dimension only: every replica already holds the whole tensor between its shard ranks. With
one rank per shard the local tensor IS the full tensor and is yielded as it is, without a copy:
consumers must copy what they keep and never write into it.

Anything else that is not a regular tensor goes through `full_tensor()` unchanged, so the result
never depends on the bucketing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ballast.engine.dist import all_gather_single

# Full-tensor bytes per bucket: large enough that a small model is one collective, small enough
# that the extra copy of a bucket stays a modest share of a large model's memory.
DEFAULT_BUCKET_BYTES = 256 << 20


def _is_dim0_shard(tensor: torch.Tensor) -> bool:
    """A dim-0 shard over a 1-D mesh, or over the last dim of a hybrid (replicate, shard) mesh."""
    if not isinstance(tensor, DTensor) or tensor.dim() < 1:
        return False
    placements = tuple(tensor.placements)
    if tensor.device_mesh.ndim == 1:
        return placements == (Shard(0),)
    return tensor.device_mesh.ndim == 2 and placements == (Replicate(), Shard(0))


def _shard_dim(tensor: DTensor) -> int:
    return tensor.device_mesh.ndim - 1


def _rows_per_rank(tensor: DTensor) -> int:
    return math.ceil(tensor.shape[0] / tensor.device_mesh.size(_shard_dim(tensor)))


def _gather_bucket(items: list[tuple[str, DTensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """One all-gather for every dim-0-sharded tensor of `items` (same mesh, same dtype)."""
    first = items[0][1]
    world = first.device_mesh.size(_shard_dim(first))
    if world == 1:  # a whole replica on every rank: nothing to gather
        for name, tensor in items:
            yield name, tensor.to_local().detach()
        return
    group = first.device_mesh.get_group(_shard_dim(first))
    layout, size = [], 0
    for name, tensor in items:
        numel = _rows_per_rank(tensor) * math.prod(tensor.shape[1:])
        layout.append((name, tensor, size, numel))
        size += numel
    # One copy in: each local shard straight into its slot, only the padding rows zeroed.
    flat = torch.empty(size, dtype=first.dtype, device=first.to_local().device)
    for _, tensor, offset, numel in layout:
        local = tensor.to_local().detach().reshape(-1)
        flat[offset:offset + local.numel()].copy_(local)
        flat[offset + local.numel():offset + numel].zero_()
    gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    all_gather_single(gathered, flat, group=group)
    per_rank = gathered.view(world, size)
    for name, tensor, offset, numel in layout:
        shape = tuple(tensor.shape)
        # rank r's padded rows, in rank order, are rows [r * rows, (r + 1) * rows) of the full tensor;
        # (the reshape of this strided slice is the one copy out; the row prefix of it stays contiguous)
        full = per_rank[:, offset:offset + numel].reshape(-1, *shape[1:])[:shape[0]]
        yield name, full.contiguous()


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def layer_of(name: str) -> str | None:
    """The decoder layer a parameter name belongs to (`model.layers.3`), or None outside the layers."""
    match = _LAYER.match(name)
    return match.group(1) if match else None


def iter_gathered(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                  boundary: Callable[[str], object] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every (name, tensor) of `named`, in order. Collective: every rank of
    the shards' mesh must call it with the same sequence of names, shapes and placements.

    `boundary`: a bucket never holds two names for which it differs (`layer_of`: one decoder layer per
    bucket at most, which bounds the gathered memory by a layer rather than by `bucket_bytes`)."""
    bucket: list[tuple[str, DTensor]] = []
    size = 0

    def flush() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal bucket, size
        if bucket:
            yield from _gather_bucket(bucket)
        bucket, size = [], 0

    for name, tensor in named:
        if not _is_dim0_shard(tensor):
            yield from flush()
            yield name, (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
            continue
        if bucket and (tensor.device_mesh != bucket[0][1].device_mesh or tensor.dtype != bucket[0][1].dtype
                       or size + tensor.numel() * tensor.element_size() > bucket_bytes
                       or (boundary is not None and boundary(name) != boundary(bucket[0][0]))):
            yield from flush()
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    yield from flush()
