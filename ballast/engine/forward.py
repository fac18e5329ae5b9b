"""One micro-batch through the model: padded, packed, or packed + Ulysses.

Returns per-response-token outputs of shape (B, R): `log_probs` (and `entropy`) for a causal LM,
`values` for a critic. Response token j of row b is predicted by the model output at padded column
P - 1 + j; only those positions (and only real tokens) are evaluated: causal LMs get
`logits_to_keep=<those positions>`, so the vocabulary projection never runs on prompt tokens. Slots
whose response token is padding are 0. With `share_prompts` (a plan whose micro-batches hold whole
groups of rows with one prompt), the packed layout holds each distinct prompt once
(`ballast.engine.shared_prefix`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from ballast.engine import padding, shared_prefix, ulysses
from ballast.engine.attention import CONTEXT_KWARG, PackedAttentionContext
from ballast.engine.dist import ParallelState
from ballast.engine.logprob import log_probs_and_entropy


@dataclass(frozen=True)
class ForwardOptions:
    is_critic: bool
    use_remove_padding: bool
    temperature: float = 1.0
    calculate_entropy: bool = False
    chunk_tokens: int = 1024
    attn_backend: str = "auto"
    share_prompts: bool = False  # packed: each distinct prompt once (needs use_remove_padding)


def _token_outputs(logits: torch.Tensor, labels: torch.Tensor, opts: ForwardOptions) -> dict[str, torch.Tensor]:
    """Log-probs (and entropy) of `labels` under (..., N, V) logits of the kept positions."""
    logits = logits.reshape(-1, logits.shape[-1])
    log_probs, entropy = log_probs_and_entropy(
        logits, labels, opts.temperature, opts.calculate_entropy, opts.chunk_tokens
    )
    out = {"log_probs": log_probs}
    if entropy is not None:
        out["entropy"] = entropy
    return out


def _forward_padded(model, micro: TensorDict, slots: padding.ResponseSlots, labels, opts) -> dict:
    response_len = micro["responses"].shape[1]
    kwargs = dict(
        input_ids=micro["input_ids"],
        attention_mask=micro["attention_mask"],
        position_ids=micro["position_ids"],
        use_cache=False,
    )
    if opts.is_critic:
        out = model(**kwargs)
        values = out.logits[..., 0].reshape(-1)[slots.padded_pos].float()
        return {"values": values}
    # Columns P-1 .. S-1; column j of the kept block predicts response token j.
    out = model(**kwargs, logits_to_keep=response_len + 1)
    return _token_outputs(out.logits[:, :response_len][slots.rows, slots.cols], labels, opts)


def _pack(micro: TensorDict, slots: padding.ResponseSlots, opts: ForwardOptions):
    """(input ids (T,), position ids (T,), output position of every response slot (N,), attention
    context without its SP group) of the packed micro-batch, plain or with shared prompts."""
    if opts.share_prompts:
        pack = shared_prefix.pack_shared(micro["input_ids"], micro["attention_mask"], micro["position_ids"], slots)
        ctx = PackedAttentionContext(cu_seqlens=pack.cu_seqlens, max_seqlen=pack.max_seqlen, backend=opts.attn_backend,
                                     shared=pack.groups)
        return pack.input_ids, pack.position_ids, pack.packed_pos, ctx
    packed = padding.unpad(micro["input_ids"], micro["attention_mask"])
    position_ids = micro["position_ids"].reshape(-1)[packed.flat_indices]
    ctx = PackedAttentionContext(cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen, backend=opts.attn_backend)
    return packed.input_ids, position_ids, slots.packed_pos, ctx


def _forward_packed(model, micro: TensorDict, slots, labels, opts, parallel: ParallelState | None) -> dict:
    input_ids, position_ids, packed_pos, ctx = _pack(micro, slots, opts)
    sp = parallel.sp_size if parallel is not None else 1
    if sp > 1:
        if opts.share_prompts:  # a shared last prompt token predicts several responses' first tokens
            raise ValueError("shared prompts do not run under Ulysses sequence parallelism (sp_size > 1)")
        ctx = dataclasses.replace(ctx, sp_group=parallel.sp_group)
    if sp == 1:
        kwargs = dict(
            input_ids=input_ids.unsqueeze(0),
            position_ids=position_ids.unsqueeze(0),
            attention_mask=None,
            use_cache=False,
            **{CONTEXT_KWARG: ctx},
        )
        if opts.is_critic:
            values = model(**kwargs).logits[0, :, 0][packed_pos].float()
            return {"values": values}
        return _token_outputs(model(**kwargs, logits_to_keep=packed_pos).logits, labels, opts)

    # Ulysses: pad the packed sequence to a multiple of sp, run our slice, gather per-token results.
    ids_full, _ = ulysses.pad_to_multiple(input_ids, sp)
    pos_full, _ = ulysses.pad_to_multiple(position_ids, sp)
    local_len = ids_full.shape[0] // sp
    start = parallel.sp_rank * local_len
    kwargs = dict(
        input_ids=ulysses.slice_for_rank(ids_full, parallel.sp_rank, sp).unsqueeze(0),
        position_ids=ulysses.slice_for_rank(pos_full, parallel.sp_rank, sp).unsqueeze(0),
        attention_mask=None,
        use_cache=False,
        **{CONTEXT_KWARG: ctx},
    )
    if opts.is_critic:
        local_values = model(**kwargs).logits[0, :, 0].float()
        values = ulysses.gather_sequence(local_values, parallel.sp_group)
        return {"values": values[packed_pos]}
    mine = (packed_pos >= start) & (packed_pos < start + local_len)
    local_pos = packed_pos[mine] - start
    local = _token_outputs(model(**kwargs, logits_to_keep=local_pos).logits, labels[mine], opts)
    result = {}
    for key, vals in local.items():
        dense = vals.new_zeros(local_len).index_copy(0, local_pos, vals)
        result[key] = ulysses.gather_sequence(dense, parallel.sp_group)[packed_pos]
    return result


def forward_micro_batch(
    model: torch.nn.Module,
    micro: TensorDict,
    opts: ForwardOptions,
    parallel: ParallelState | None = None,
) -> dict[str, torch.Tensor]:
    """Run `micro` (padded layout) through `model`; returns {name: (B, R)} in micro's row order."""
    attention_mask = micro["attention_mask"]
    responses = micro["responses"]
    batch, response_len = responses.shape
    slots = padding.response_slots(attention_mask, response_len)
    labels = responses[slots.rows, slots.cols]
    if opts.use_remove_padding:
        per_slot = _forward_packed(model, micro, slots, labels, opts, parallel)
    elif opts.share_prompts:
        raise ValueError("shared prompts run in the packed layout only: set use_remove_padding=True")
    else:  # SP > 1 never gets here: EngineConfig requires use_remove_padding=True for it
        per_slot = _forward_padded(model, micro, slots, labels, opts)
    return {key: padding.scatter_response(v, slots, batch, response_len) for key, v in per_slot.items()}
