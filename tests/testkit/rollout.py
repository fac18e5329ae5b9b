"""Reference values for rollout outputs, computed the slow, obvious way with a Hugging Face model."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ballast.workers.rollout.base import SamplingConfig
from ballast.workers.rollout.hf_backend import apply_sampling_filters


def filtered_log_probs(model, out: TensorDict, row: int, prompt_len: int, sampling: SamplingConfig) -> torch.Tensor:
    """The log-prob of each response token of `out` row `row` under the distribution it was drawn
    from (temperature, top-k and top-p applied), from one teacher-forced pass over its real tokens."""
    seq = out["input_ids"][row][out["attention_mask"][row].bool()]
    with torch.no_grad():
        logits = model(seq[None], use_cache=False).logits[0, prompt_len - 1:-1]
    filtered = apply_sampling_filters(logits, sampling)
    return torch.log_softmax(filtered, -1).gather(1, seq[prompt_len:, None])[:, 0]
