"""Rule rewards on the driver: decode each response, score it, place the score on its last token.

The score function is the built-in one for the sample's `data_source` (see `ballast.data.rewards`) or
`custom_reward_function.path/name`. A function that raises or returns something that is not a finite
number (or a dict with a "score") is a `RewardFunctionError` naming the row, data source and what
the function returned; nothing is skipped.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch

from ballast.data import default_compute_score, load_custom_reward_fn, validate_score
from ballast.protocol import Batch


class RewardFunctionError(ValueError):
    """The score function raised, or returned something that is not a finite score."""


@dataclass(frozen=True)
class OverlongBuffer:
    """DAPO's soft overlong punishment: a response longer than max_response_length - buffer_len loses
    penalty_factor * (excess / buffer_len) of reward (linear, reaching -penalty_factor at the limit)."""

    max_response_length: int
    buffer_len: int
    penalty_factor: float
    log: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.buffer_len <= self.max_response_length:
            raise ValueError(f"reward_model.overlong_buffer.len={self.buffer_len} must be in (0, "
                             f"data.max_response_length={self.max_response_length}]")

    def penalty(self, response_length: int) -> float:
        excess = response_length - (self.max_response_length - self.buffer_len)
        return min(-excess / self.buffer_len * self.penalty_factor, 0.0)


class RewardManager:
    def __init__(self, tokenizer, compute_score: Optional[Callable] = None, reward_fn_key: str = "data_source",
                 overlong: Optional[OverlongBuffer] = None):
        self.tokenizer = tokenizer
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key
        self.overlong = overlong

    @classmethod
    def from_config(cls, tokenizer, path: Optional[str], name: str, reward_fn_key: str,
                    overlong: Optional[OverlongBuffer] = None) -> "RewardManager":
        fn = load_custom_reward_fn(path, name) if path else None
        return cls(tokenizer, fn, reward_fn_key, overlong)

    def __call__(self, batch: Batch) -> Tuple[torch.Tensor, Dict[str, np.ndarray]]:
        """(token_level_scores (B, R) float32, extra per-sample values returned by the score function)."""
        responses, mask = batch["responses"], batch["response_mask"]
        lengths = mask.sum(dim=-1).tolist()
        sources = batch[self.reward_fn_key] if self.reward_fn_key in batch else np.array(["unknown"] * len(batch))
        truths = batch["ground_truth"] if "ground_truth" in batch else [
            (rm or {}).get("ground_truth") for rm in batch["reward_model"]]
        extra_infos = batch["extra_info"] if "extra_info" in batch else [None] * len(batch)
        scores = torch.zeros(responses.shape, dtype=torch.float32)
        extras: Dict[str, list] = defaultdict(list)
        for i, length in enumerate(lengths):
            text = self.tokenizer.decode(responses[i, :length].tolist(), skip_special_tokens=True)
            try:
                raw = self.compute_score(sources[i], text, truths[i], extra_infos[i])
            except Exception as err:
                raise RewardFunctionError(
                    f"reward function failed on row {i} (data_source {sources[i]!r}): {type(err).__name__}: {err}"
                ) from err
            try:
                result = validate_score(raw, index=i, data_source=str(sources[i]))
            except ValueError as err:
                raise RewardFunctionError(str(err)) from None
            score = result["score"]
            if self.overlong is not None:
                penalty = self.overlong.penalty(length)
                score += penalty
                if self.overlong.log:
                    extras["overlong_reward"].append(penalty)
                    extras["overlong"].append(float(penalty < 0))
            if length > 0:
                scores[i, length - 1] = score
            for key, value in result.items():
                if key != "score" and isinstance(value, (int, float)):
                    extras[key].append(float(value))
                elif key == "pred" and isinstance(value, str):  # the answer a majority vote counts (maj@n)
                    extras[key].append(value)
        return scores, {k: np.asarray(v) for k, v in extras.items() if len(v) == len(lengths)}
