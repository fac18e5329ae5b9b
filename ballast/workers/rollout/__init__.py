"""Rollout backends (vLLM, HF), their request-level cores and weight sync.

Nothing here imports Ray: the rollout worker (a Ray actor) wraps these. vLLM is imported only when
a `VLLMBackend` is built, so the HF backend and the pure functions work without it. Every generate
call runs agent loops over a backend's core (`ballast.workers.agent_loop`):

    backend = build_backend(RolloutConfig(model_path=..., backend="vllm", sampling=SamplingConfig(...)))
    out = AgentLoopRunner(backend).generate(Batch(prompts)).tensors   # single-turn: the batched rollout
    load_weights(backend, actor_engine.iter_full_state_dict())

The modules, grouped by what changes together:
  * the backend contract and the request core: `base` (configs, `RolloutBackend`, call numbering),
    `async_engine` (requests, `EngineCore`, the asyncio engine), `prompts` (prompt checks), `resume`
    (partial rollouts);
  * the vLLM backend: `vllm_backend` (engine, `VLLMCore`), `vllm_lora` (serving adapters),
    `single_device_tp`, `vllm_shm`, and `vllm_internals`, the only module that touches vLLM's
    private API (pinned to one vLLM version: an upgrade starts there);
  * the HF backend: `hf_backend` (engine, `HFCore`);
  * weight transfer: `weight_sync`.
"""

from __future__ import annotations

import torch

from .base import RolloutBackend, RolloutConfig, SamplingConfig
from .prompts import prompt_token_lists
from .weight_sync import iter_full_tensors, load_weights


def build_backend(config: RolloutConfig, model: torch.nn.Module | None = None) -> RolloutBackend:
    """The backend named by `config.backend`. `model` (HF only) reuses an already built module."""
    if config.backend == "hf":
        from .hf_backend import HFBackend

        return HFBackend(config, model=model)
    if model is not None:
        raise ValueError("model= is only accepted by the hf backend; vLLM loads config.model_path itself")
    from .vllm_backend import VLLMBackend

    return VLLMBackend(config)


__all__ = [
    "RolloutBackend",
    "RolloutConfig",
    "SamplingConfig",
    "build_backend",
    "iter_full_tensors",
    "load_weights",
    "prompt_token_lists",
]
