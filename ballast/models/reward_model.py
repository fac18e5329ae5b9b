"""Reward-model directories from a causal LM: the same backbone under a one-label sequence-classifier
head (`AutoModelForSequenceClassification`, `num_labels=1`), saved with the LM's tokenizer (or
another one), in the layout `reward.reward_model.model_path` reads."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "chat_template.jinja")


def save_reward_model(lm_dir: str | os.PathLike, out_dir: str | os.PathLike, *, seed: int = 0,
                      tokenizer_dir: str | os.PathLike | None = None, head_std: float = 0.02):
    """Write the backbone of the causal LM in `lm_dir` under a fresh score head (normal, std `head_std`,
    seeded) to `out_dir`, with the tokenizer of `tokenizer_dir` (default: the LM's); returns the model."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(lm_dir)
    config.num_labels = 1
    config.architectures = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(lm_dir, config=config, dtype=torch.float32)
        torch.nn.init.normal_(model.score.weight, std=head_std)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    source = Path(tokenizer_dir or lm_dir)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, Path(out_dir) / name)
    return model
