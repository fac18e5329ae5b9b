"""A pipeline engine's weights: gradient sums across replicas and tied copies, the clipped step,
every rank's view of the whole model (weight sync, export), checkpoints.

Gradients. After a schedule step each rank holds its stages' gradients of its replica's share of the
mini-batch. The replicas of a stage (its DP group) sum theirs with one all-reduce of a flat buffer;
the two copies of a tied vocabulary matrix (first stage: the embedding, last stage: the head) are
summed over the tied group instead, which spans every replica's first and last rank, so both copies
end with the gradient of the one shared matrix and, stepped by identical AdamW updates, stay equal.

Norm. The global gradient norm sums every stage's squares over the pipeline group, the tied matrix
counted once (at the first stage), and clips with the rule of ``torch.nn.utils.clip_grad_norm_``;
a non-finite norm skips the step on every rank (the norm is the same everywhere).

Full weights. Each weight lives on one pipeline rank; :func:`iter_full_state` broadcasts them over
the pipeline group in buckets (one broadcast per bucket of consecutive names owned by one rank) and
yields them in the unpruned model's ``state_dict`` order on every rank, a tied weight under both names.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ballast.engine.gather import DEFAULT_BUCKET_BYTES, layer_of
from ballast.engine.optim import step_or_skip
from ballast.engine.pipeline.layout import PipelineParallelState


@dataclass(frozen=True)
class FullName:
    """One entry of the unpruned model's state dict and the pipeline rank that holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    owner: int  # pipeline rank


def _all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """SUM-all-reduce ``tensors`` in place with one collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in group_tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def sync_gradients(named_params: dict[str, torch.nn.Parameter], tied: tuple[str, ...],
                   parallel: PipelineParallelState) -> None:
    """Sum gradients over the stage's replicas, and a tied matrix's over both ends of every replica.
    Every trainable parameter gets a gradient first (zeros where the step produced none), so every
    rank reduces the same buffers. Collective over the DP group and the tied group."""
    for p in named_params.values():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    plain = [p.grad for n, p in named_params.items() if p.requires_grad and n not in tied]
    if parallel.dp_size > 1 and plain:
        _all_reduce_flat(plain, parallel.dp_group)
    ends = [named_params[n].grad for n in tied if n in named_params]
    if parallel.tied_group is not None and tied:
        _all_reduce_flat(ends, parallel.tied_group)


def clip_and_step(named_params: dict[str, torch.nn.Parameter], counted_once: tuple[str, ...], optimizer, scheduler,
                  max_norm: float | None, parallel: PipelineParallelState) -> tuple[float, bool]:
    """The global gradient norm (``counted_once`` names skipped here: their other copy counts), the
    clip, and the step unless the norm is not finite. Returns (norm, stepped). Collective over the
    pipeline group."""
    grads = [p.grad for n, p in named_params.items() if p.grad is not None and n not in counted_once]
    squares = torch.zeros((), dtype=torch.float64, device=parallel.device)
    for g in grads:
        squares += g.detach().double().pow(2).sum()
    dist.all_reduce(squares, group=parallel.pp_group)
    norm = float(squares.sqrt())
    stepped = math.isfinite(norm)
    if stepped and max_norm is not None:
        coeff = min(max_norm / (norm + 1e-6), 1.0)
        for p in named_params.values():
            if p.grad is not None:
                p.grad.mul_(coeff)
    step_or_skip(optimizer, scheduler, stepped)
    return norm, stepped


def _buckets(names: list[FullName], bucket_bytes: int, layered: bool) -> Iterator[list[FullName]]:
    """Consecutive names with one owner and dtype, at most ``bucket_bytes`` (and one layer if ``layered``)."""
    bucket: list[FullName] = []
    size = 0
    for entry in names:
        nbytes = math.prod(entry.shape) * entry.dtype.itemsize
        if bucket and (entry.owner != bucket[0].owner or entry.dtype != bucket[0].dtype
                       or size + nbytes > bucket_bytes or (layered and layer_of(entry.name) != layer_of(bucket[0].name))):
            yield bucket
            bucket, size = [], 0
        bucket.append(entry)
        size += nbytes
    if bucket:
        yield bucket


def iter_full_state(local: dict[str, torch.Tensor], names: list[FullName], parallel: PipelineParallelState,
                    layered: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every weight of the model, in ``names`` order, on every rank of the
    pipeline. ``local``: this rank's own tensors by name. Collective over the pipeline group."""
    base = parallel.dp_rank * parallel.pp_size
    for bucket in _buckets(names, bucket_bytes, layered):
        owner = bucket[0].owner
        numel = sum(math.prod(e.shape) for e in bucket)
        if parallel.pp_rank == owner:
            flat = torch.cat([local[e.name].detach().reshape(-1) for e in bucket])
        else:
            flat = torch.empty(numel, dtype=bucket[0].dtype, device=parallel.device)
        dist.broadcast(flat, src=base + owner, group=parallel.pp_group)
        offset = 0
        for e in bucket:
            n = math.prod(e.shape)
            yield e.name, flat[offset:offset + n].view(e.shape)
            offset += n
