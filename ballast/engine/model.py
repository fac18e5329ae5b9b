"""Load the engine's module from a local Hugging Face model directory.

Actor and reference: `AutoModelForCausalLM`. Critic: `AutoModelForTokenClassification` with one label
(a per-token value head on the same backbone; the head is freshly initialised unless the directory
already holds one). Reward model: a saved one-label sequence classifier, loaded as the token
classifier of the same backbone with its bias-free head, so every position gets the score the
classifier would give the sequence ending there (`load_reward_model`). Weights are loaded in float32 (FSDP2's mixed-precision policy casts for compute),
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
        elif role == "reward":
            model = load_reward_model(model_path, trust_remote_code, common)
        elif role == "critic":
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            config.num_labels = 1
            # Dropout on the value head would make values depend on the RNG and on the cut into
            # micro-batches; the critic regresses, it does not need it.
            config.classifier_dropout = 0.0
            model = AutoModelForTokenClassification.from_pretrained(model_path, config=config, **common)
        else:
            raise ValueError(f"role must be 'actor', 'ref', 'critic' or 'reward', got {role!r}")
    model.config.use_cache = False
    attention.install(model)
    if role in ("ref", "reward"):
        model.requires_grad_(False)
    return model


def reward_model_problem(model_path: str, trust_remote_code: bool = False) -> str | None:
    """Why the directory cannot serve as a reward model (None when it can): it must hold a
    `*ForSequenceClassification` with one label."""
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    arch = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in arch):
        return (f"{model_path!r} holds {arch or 'no architecture'}, not a sequence classifier "
                "(save an AutoModelForSequenceClassification with num_labels=1)")
    if config.num_labels != 1:
        return f"{model_path!r} is a sequence classifier with num_labels={config.num_labels}; a reward model has 1"
    return None


def load_reward_model(model_path: str, trust_remote_code: bool, common: dict) -> PreTrainedModel:
    """The one-label sequence classifier in `model_path` as a token classifier: same backbone, same
    bias-free `score` head, no dropout; a head missing from the weights is an error, not a fresh init."""
    problem = reward_model_problem(model_path, trust_remote_code)
    if problem is not None:
        raise ValueError(problem)
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    config.classifier_dropout = 0.0
    config.token_classification_bias = False  # the sequence classifier's head has none
    model, info = AutoModelForTokenClassification.from_pretrained(model_path, config=config, output_loading_info=True,
                                                                  **common)
    if info["missing_keys"]:
        raise ValueError(f"{model_path!r}: weights missing from the reward model: {sorted(info['missing_keys'])[:5]}")
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
