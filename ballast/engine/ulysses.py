"""Ulysses sequence parallelism: the tensor plumbing, with autograd.

An SP group of `sp` ranks holds the same micro-batch. The packed (T,) token sequence is padded to a
multiple of `sp` and each rank runs the model on its own contiguous slice of T_pad / sp tokens. Every
token-wise layer is unaffected; inside attention an all-to-all trades the sequence shard for a head
shard (each rank then sees the whole sequence for H / sp heads), attention runs per packed sequence,
and a second all-to-all trades back. Per-token outputs are gathered at the end.

Gradient bookkeeping: every SP rank computes the same loss from the gathered outputs, and
`gather_sequence` sends back to each rank only the gradient of its own slice. So the parameter
gradients of the SP ranks SUM to the gradient of that loss; the engine makes FSDP sum (not average)
across ranks, which is then exact. (The all-to-alls are exact in both directions.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ballast.engine.dist import all_gather_single


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int = 0, value: float = 0) -> tuple[torch.Tensor, int]:
    """Pad `x` along `dim` up to a multiple of `multiple`; returns (padded, number of pad entries)."""
    size = x.shape[dim]
    pad = (-size) % multiple
    if pad == 0:
        return x, 0
    widths = [0, 0] * (x.dim() - dim - 1) + [0, pad]
    return F.pad(x, widths, value=value), pad


def slice_for_rank(x: torch.Tensor, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    """The `rank`-th of `world` equal contiguous chunks of `x` along `dim` (size must divide)."""
    size = x.shape[dim]
    if size % world:
        raise ValueError(f"cannot slice a dimension of {size} into {world} equal parts")
    chunk = size // world
    return x.narrow(dim, rank * chunk, chunk)


def _a2a(inp: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """all_to_all_single over dim 0 of a contiguous (world, ...) tensor."""
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, H, T_local, D) sequence-sharded -> (B, H / sp, T_local * sp, D) head-sharded."""
    sp = dist.get_world_size(group)
    b, h, t, d = x.shape
    inp = x.reshape(b, sp, h // sp, t, d).permute(1, 0, 2, 3, 4).contiguous()
    out = _a2a(inp, group)  # out[i]: my head chunk of rank i's sequence slice
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * t, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, H / sp, T_local * sp, D) head-sharded -> (B, H, T_local, D) sequence-sharded."""
    sp = dist.get_world_size(group)
    b, hl, tt, d = x.shape
    inp = x.reshape(b, hl, sp, tt // sp, d).permute(2, 0, 1, 3, 4).contiguous()
    out = _a2a(inp, group)  # out[i]: rank i's head chunk of my sequence slice
    return out.permute(1, 0, 2, 3, 4).reshape(b, sp * hl, tt // sp, d)


class _AllToAll(torch.autograd.Function):
    """One of the two layout changes; its gradient is the other one (they are exact inverses)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inverse = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return inverse(grad.contiguous(), ctx.group), None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Autograd all-to-all: (B, H, T_local, D) -> (B, H / sp, T_pad, D). H must divide by sp."""
    sp = dist.get_world_size(group)
    if x.shape[1] % sp:
        raise ValueError(f"Ulysses needs the head count ({x.shape[1]}) divisible by sp={sp}")
    return _AllToAll.apply(x, group, True)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Autograd all-to-all, inverse of `seq_to_heads`: (B, H / sp, T_pad, D) -> (B, H, T_local, D)."""
    return _AllToAll.apply(x, group, False)


def repeat_kv_for_sp(kv: torch.Tensor, num_q_heads: int, sp: int) -> torch.Tensor:
    """Repeat KV heads of (B, H_kv, T, D) so that they split evenly over `sp` ranks.

    When H_kv divides by sp each rank gets H_kv / sp KV heads matching its H / sp query heads and
    nothing is repeated. Otherwise (e.g. 2 KV heads on sp = 4) each KV head is repeated to one per
    query head, so the all-to-all moves every rank the KV heads its query heads use.
    """
    h_kv = kv.shape[1]
    if h_kv % sp == 0:
        return kv
    return kv.repeat_interleave(num_q_heads // h_kv, dim=1)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        sp = dist.get_world_size(group)
        ctx.rank, ctx.local = dist.get_rank(group), x.shape[0]
        out = x.new_empty((sp * x.shape[0], *x.shape[1:]))
        all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Each SP rank holds the same downstream loss; keep only the gradient of our own slice so the
        # SP ranks' parameter gradients sum (not multiply) to the true one.
        return grad.narrow(0, ctx.rank * ctx.local, ctx.local).contiguous(), None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather equal (T_local, ...) slices along dim 0 into (T_pad, ...), rank order."""
    return _GatherSequence.apply(x, group)
