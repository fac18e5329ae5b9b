"""The one attention entry point of the engine, registered with transformers.

`ATTN_IMPLEMENTATION` is registered in BOTH `AttentionInterface` (the attention itself) and
`AttentionMaskInterface` (the mask builder). Registering only the former makes transformers hand
`attention_mask=None` to the function, silently dropping padding masks (docs/engine.md, "transformers and torch on CPU").

Paths, chosen per call:

* padded batch (a 2-D padding mask was given): the mask builder returns transformers' sdpa mask and
  the attention runs SDPA with it;
* packed batch (no padding mask): causal attention separately for every packed sequence, split by
  `cu_seqlens` (from the `PackedAttentionContext` passed as the `ballast_packed` model kwarg, else
  derived from `position_ids` restarting at 0). The mask builder returns None, so no dense (T, T)
  mask is ever built. On CUDA with flash-attn installed and a half-precision dtype this is one
  `flash_attn_varlen_func` call; otherwise one SDPA call per sequence;
* shared prompts (a context with `shared` groups): each group's prompt once, every response
  attending to it and to its own earlier tokens (`ballast.engine.shared_prefix`);
* Ulysses (context with an SP group): all-to-all from sequence shards to head shards, the packed (or
  shared) path on the full sequence, all-to-all back.

On CPU, bf16/fp16 attention is computed in fp32 and its output cast back (`_in_fp32_on_cpu`): torch's
CPU SDPA backward in bf16 is about ten times slower than in fp32, and attention is a small share of a
step's FLOPs. The upcast applies in every path and with or without autograd, so the log-probs of a
no-grad forward and of a training forward stay the same numbers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ballast.engine import ulysses
from ballast.engine.padding import cu_seqlens_from_position_ids
from ballast.engine.shared_prefix import SharedGroup, shared_prefix_attention

ATTN_IMPLEMENTATION = "ballast_varlen"
CONTEXT_KWARG = "ballast_packed"


@dataclass(frozen=True)
class PackedAttentionContext:
    """What attention needs about a packed micro-batch, passed through `model(..., ballast_packed=ctx)`.

    `cu_seqlens` (num_seqs + 1,) int32 and `max_seqlen` describe the FULL packed sequence of T real
    tokens (under Ulysses every rank only holds a slice, so it cannot derive them from its own
    position ids). Positions T..T_pad-1 are divisibility padding and attend to nothing. `shared`: the
    groups of a shared-prompt pack (then each `cu_seqlens` segment is one group).
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    sp_group: dist.ProcessGroup | None = None
    backend: str = "auto"  # auto | sdpa | flash
    shared: tuple[SharedGroup, ...] | None = None


@functools.cache
def flash_attn_varlen():
    """flash_attn.flash_attn_varlen_func, or None when flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _use_flash(backend: str, q: torch.Tensor) -> bool:
    if backend == "sdpa":
        return False
    usable = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_varlen() is not None
    if backend == "flash" and not usable:
        raise RuntimeError(
            "attn_backend='flash' needs CUDA tensors in fp16/bf16 and the flash-attn package "
            f"(device={q.device}, dtype={q.dtype}, flash-attn installed={flash_attn_varlen() is not None})"
        )
    return usable


def _in_fp32_on_cpu(attention):
    """Run `attention(q, k, v, ...)` in fp32 when q is a half-precision CPU tensor; output in q's dtype.

    Measured on the real model's update (Intel Xeon with AMX, one thread): SDPA's backward took 1.86 s
    of a 5.3 s bf16 forward+backward against 0.17 s in fp32, while the matmuls it surrounds ran 2.5x
    faster in bf16. The upcast copies q/k/v once per layer, far cheaper than the slow kernel.
    """

    @functools.wraps(attention)
    def wrapped(q, k, v, *args, **kwargs):
        if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
            return attention(q, k, v, *args, **kwargs)
        return attention(q.float(), k.float(), v.float(), *args, **kwargs).to(q.dtype)

    return wrapped


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scaling: float | None,
    dropout: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention inside each packed sequence. q (1, H, L, D), k/v (1, H_kv, L, D) -> (1, L, H, D).

    Positions at or beyond `cu_seqlens[-1]` (Ulysses padding) get zero output.
    """
    _, h, length, d = q.shape
    total = int(cu_seqlens[-1])
    out = q.new_zeros((1, length, h, d))
    if total == 0:
        return out
    if _use_flash(backend, q):
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        res = flash_attn_varlen()(
            q[0, :, :total].transpose(0, 1),
            k[0, :, :total].transpose(0, 1),
            v[0, :, :total].transpose(0, 1),
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            dropout_p=dropout,
            softmax_scale=scaling,
            causal=True,
        )
        return torch.cat([res.unsqueeze(0), out[:, total:]], dim=1)
    bounds = cu_seqlens.tolist()
    sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    if length > total:
        sizes.append(length - total)
    # One split per tensor rather than a slice per sequence: a split's backward is one concatenation,
    # a slice's fills a zero tensor of the whole packed length and adds into it.
    qs, ks, vs = q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2)
    gqa = h != k.shape[1]
    pieces = [F.scaled_dot_product_attention(qs[i], ks[i], vs[i], dropout_p=dropout, is_causal=True, scale=scaling,
                                             enable_gqa=gqa)
              for i in range(len(bounds) - 1) if sizes[i] > 0]
    res = torch.cat(pieces, dim=2).transpose(1, 2)
    return torch.cat([res, out[:, total:]], dim=1)


@_in_fp32_on_cpu
def _packed_rows(q, k, v, position_ids, scaling, dropout, backend) -> torch.Tensor:
    """Packed attention without a context: derive each row's segments from its position ids."""
    outs = []
    for row in range(q.shape[0]):
        if position_ids is None:
            cu = torch.tensor([0, q.shape[2]], dtype=torch.int32)
        else:
            cu = cu_seqlens_from_position_ids(position_ids[min(row, position_ids.shape[0] - 1)])
        max_len = int((cu[1:] - cu[:-1]).max())
        outs.append(
            varlen_causal_attention(q[row : row + 1], k[row : row + 1], v[row : row + 1], cu, max_len, scaling, dropout, backend)
        )
    return torch.cat(outs, dim=0)


@_in_fp32_on_cpu
def _context_attention(q, k, v, ctx: PackedAttentionContext, scaling, dropout) -> torch.Tensor:
    if ctx.shared is not None:
        return shared_prefix_attention(q, k, v, ctx.shared, scaling, dropout)
    return varlen_causal_attention(q, k, v, ctx.cu_seqlens, ctx.max_seqlen, scaling, dropout, ctx.backend)


def _ulysses(q, k, v, ctx: PackedAttentionContext, scaling, dropout) -> torch.Tensor:
    group = ctx.sp_group
    sp = dist.get_world_size(group)
    num_q_heads = q.shape[1]
    k = ulysses.repeat_kv_for_sp(k, num_q_heads, sp)
    v = ulysses.repeat_kv_for_sp(v, num_q_heads, sp)
    q_full = ulysses.seq_to_heads(q, group)
    k_full = ulysses.seq_to_heads(k, group)
    v_full = ulysses.seq_to_heads(v, group)
    out = _context_attention(q_full, k_full, v_full, ctx, scaling, dropout)
    # (1, T_pad, H/sp, D) -> head-major for the all-to-all, then back to (1, T_local, H, D)
    out = ulysses.heads_to_seq(out.transpose(1, 2).contiguous(), group)
    return out.transpose(1, 2)


@_in_fp32_on_cpu
def _padded_attention(q, k, v, module, attention_mask, scaling, dropout) -> torch.Tensor:
    return sdpa_attention_forward(module, q, k, v, attention_mask, dropout=dropout, scaling=scaling)[0]


def ballast_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature: q (B, H, L, D), k/v (B, H_kv, L, D) -> ((B, L, H, D), None)."""
    if sliding_window is not None:
        raise ValueError(
            f"the model uses sliding-window attention (window {sliding_window}), which {ATTN_IMPLEMENTATION} does not "
            "support: set use_sliding_window=false in the model's config.json or use_remove_padding=False"
        )
    ctx: PackedAttentionContext | None = kwargs.pop(CONTEXT_KWARG, None)
    if attention_mask is not None:
        if ctx is not None and ctx.sp_group is not None:
            raise ValueError("Ulysses attention needs packed inputs (attention_mask=None)")
        return _padded_attention(query, key, value, module, attention_mask, scaling, dropout), None
    if ctx is not None and ctx.sp_group is not None and dist.get_world_size(ctx.sp_group) > 1:
        out = _ulysses(query, key, value, ctx, scaling, dropout)
    elif ctx is not None:
        if query.shape[0] != 1:
            raise ValueError(f"a packed attention context needs batch size 1, got {query.shape[0]}")
        out = _context_attention(query, key, value, ctx, scaling, dropout)
    else:
        out = _packed_rows(query, key, value, kwargs.get("position_ids"), scaling, dropout, "auto")
    return out.contiguous(), None


def ballast_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask builder: sdpa's mask for padded batches, None (no dense mask) for packed ones."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(ATTN_IMPLEMENTATION, ballast_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ballast_mask)


def install(model: torch.nn.Module) -> None:
    """Route every attention layer of a transformers model through `ballast_attention_forward`."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"{type(model).__name__} is not a transformers PreTrainedModel")
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ValueError(
            f"model uses sliding-window attention (sliding_window={config.sliding_window}), which "
            f"{ATTN_IMPLEMENTATION} does not implement"
        )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
