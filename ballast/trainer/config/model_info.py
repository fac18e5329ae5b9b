"""The few numbers of the actor's HF config that start-up checks and workload models need.

Read straight from `config.json` so that validating a config costs no transformers import and no
model load; a missing or unreadable model directory is an error naming the key and the path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class ModelInfo:
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: Optional[int]
    head_dim: Optional[int] = None  # set where the config gives it (it need not be hidden / heads)

    @property
    def resolved_head_dim(self) -> int:
        """Each attention head's width: the config's `head_dim`, else hidden_size / num_attention_heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dir(cls, path: str, key: str = "actor_rollout_ref.model.path") -> "ModelInfo":
        from ballast.trainer.config.loader import ConfigError

        config_file = Path(path).expanduser() / "config.json"
        if not Path(path).expanduser().is_dir():
            raise ConfigError(f"{key}={path!r}: not a directory (point it at a local Hugging Face model directory)")
        if not config_file.is_file():
            raise ConfigError(f"{key}={path!r}: no config.json in the directory (not a Hugging Face model directory)")
        try:
            raw = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"{key}={path!r}: cannot read config.json: {err}") from err
        text = raw.get("text_config", raw)  # multimodal configs nest the language model's numbers
        try:
            heads = int(text["num_attention_heads"])
            return cls(
                num_attention_heads=heads,
                num_key_value_heads=int(text.get("num_key_value_heads") or heads),
                hidden_size=int(text["hidden_size"]),
                num_hidden_layers=int(text["num_hidden_layers"]),
                intermediate_size=int(text.get("intermediate_size") or 4 * int(text["hidden_size"])),
                vocab_size=int(text["vocab_size"]),
                max_position_embeddings=text.get("max_position_embeddings"),
                head_dim=int(text["head_dim"]) if text.get("head_dim") else None,
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"{key}={path!r}: config.json lacks a usable field: {err}") from err
