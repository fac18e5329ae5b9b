"""Offline models for Ballast: a random-init tiny Qwen2 + byte-level BPE tokenizer, and tokenizer loading.

Public API:
    build_tiny_model(out_dir, *, preset="tiny", seed=0, **overrides) -> Path
    tiny_model_dir(preset="tiny", *, seed=0, **overrides) -> Path     # cached build
    build_info(model_dir) -> dict                                      # what a build recorded
    save_random_qwen2(out_dir, *, seed=0, **qwen2_config) -> model     # weights only, any size
    load_tokenizer(path) -> tokenizer                                  # the one way to load one
    PRESETS, CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN
"""

from ballast.models.tiny import PRESETS, build_info, build_tiny_model, main, save_random_qwen2, tiny_model_dir
from ballast.models.tokenizer import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    load_tokenizer,
)

__all__ = [
    "PRESETS",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "IM_START_TOKEN",
    "IM_END_TOKEN",
    "build_tiny_model",
    "save_random_qwen2",
    "tiny_model_dir",
    "build_info",
    "load_tokenizer",
    "main",
]
