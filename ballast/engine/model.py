"""Load the engine's module from a local Hugging Face model directory.

Actor and reference: `AutoModelForCausalLM`. Critic: `AutoModelForTokenClassification` with one label
(a per-token value head on the same backbone; the head is freshly initialised unless the directory
already holds one). Weights are loaded in float32 (FSDP2's mixed-precision policy casts for compute),
with the KV cache disabled and attention routed through `ballast.engine.attention`.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, PreTrainedModel

from ballast.engine import attention


def _check_model_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise ValueError(f"model_path {path!r} is not a directory (the engine loads local HF model directories)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model_path {path!r} has no config.json")


def load_model(model_path: str, role: str, trust_remote_code: bool = False, seed: int = 0) -> PreTrainedModel:
    """Load the float32 module for `role` ('actor' | 'ref' | 'critic').

    `seed` fixes the initialisation of any weights missing from the directory (the critic's value head)
    so that every rank builds the identical module before FSDP shards it.
    """
    _check_model_dir(model_path)
    common = dict(dtype=torch.float32, trust_remote_code=trust_remote_code)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if role in ("actor", "ref"):
            model = AutoModelForCausalLM.from_pretrained(model_path, **common)
        elif role == "critic":
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            config.num_labels = 1
            # Dropout on the value head would make values depend on the RNG and on the cut into
            # micro-batches; the critic regresses, it does not need it.
            config.classifier_dropout = 0.0
            model = AutoModelForTokenClassification.from_pretrained(model_path, config=config, **common)
        else:
            raise ValueError(f"role must be 'actor', 'ref' or 'critic', got {role!r}")
    model.config.use_cache = False
    attention.install(model)
    if role == "ref":
        model.requires_grad_(False)
    return model


def decoder_layer_classes(model: PreTrainedModel) -> tuple[type, ...]:
    """The transformer block classes (from `_no_split_modules`), the unit FSDP2 shards separately."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(
            f"{type(model).__name__} declares no decoder-layer class in _no_split_modules ({sorted(names)}); "
            "cannot decide the FSDP wrapping units"
        )
    return tuple(classes)
