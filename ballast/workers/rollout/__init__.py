"""Rollout backends (vLLM, HF), their shared output contract, TP gather/split and weight sync.

Nothing here imports Ray: the rollout worker (a Ray actor) wraps these. vLLM is imported only when
a `VLLMBackend` is built, so the HF backend and the pure functions work without it.

    backend = build_backend(RolloutConfig(model_path=..., backend="vllm", sampling=SamplingConfig(...)))
    out = tp_generate(backend, prompts, tp_group)      # or backend.generate(prompts) without TP
    load_weights(backend, actor_engine.iter_full_state_dict())
"""

from __future__ import annotations

import torch

from .base import RolloutBackend, RolloutConfig, SamplingConfig
from .postprocess import build_rollout_output, prompt_token_lists
from .tp import gather_prompts, new_tp_group, split_rank_output, tp_generate, tp_group_ranks
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
    "build_rollout_output",
    "gather_prompts",
    "iter_full_tensors",
    "load_weights",
    "new_tp_group",
    "prompt_token_lists",
    "split_rank_output",
    "tp_generate",
    "tp_group_ranks",
]
