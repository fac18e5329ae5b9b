"""The prompts of a rollout call, as pure functions: left-padded rows in, checked token lists out.

Input (one row per sample; the driver has already repeated prompts `n` times):
  input_ids (B, P) int64, LEFT-padded; attention_mask (B, P) 0 on padding then 1;
  position_ids (B, P) optional (default: cumsum(mask) - 1, clamped at 0).
What a call returns is built from its finished conversations (`agent_loop/output.py`; the contract is
in docs/rollout.md). A response is cut after its first eos/stop token (`truncate_at_stop`): engines that
keep writing past it (HF generate pads finished rows) never leak tokens into the mask.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch


def _check_prompt_tensors(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
            "must both be (B, P)"
        )
    if input_ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    bad = ~((attention_mask == 0) | (attention_mask == 1))
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"attention_mask[{row}, {col}] = {attention_mask[row, col].item()} is not 0 or 1")


def prompt_token_lists(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The real (unpadded) token ids of each left-padded prompt row.

    Raises ValueError for a row that is empty or not left-padded (a 0 in its mask after a 1).
    """
    _check_prompt_tensors(input_ids, attention_mask)
    mask = attention_mask.to(torch.bool)
    # Left padding means the mask never drops from 1 back to 0 along a row.
    drops = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1)
    if drops.any():
        row = int(drops.nonzero()[0])
        raise ValueError(
            f"prompt row {row} is not left-padded: attention_mask={attention_mask[row].tolist()}"
        )
    empty = ~mask.any(dim=1)
    if empty.any():
        raise ValueError(f"prompt row {int(empty.nonzero()[0])} has no tokens (attention_mask all 0)")
    lengths = mask.sum(dim=1).tolist()
    width = input_ids.shape[1]
    rows = input_ids.tolist()
    return [row[width - n:] for row, n in zip(rows, lengths)]


def read_prompts(prompts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """(input_ids, attention_mask, position_ids, real token lists) of a prompts TensorDict/mapping.

    Only these three keys are read; anything else in `prompts` is ignored (the worker keeps it).
    """
    for key in ("input_ids", "attention_mask"):
        if key not in prompts.keys():
            raise ValueError(f"prompts are missing {key!r}; got keys {sorted(prompts.keys())}")
    input_ids, attention_mask = prompts["input_ids"], prompts["attention_mask"]
    token_lists = prompt_token_lists(input_ids, attention_mask)
    position_ids = prompts["position_ids"] if "position_ids" in prompts.keys() else None
    if position_ids is None:
        position_ids = default_position_ids(attention_mask)
    elif position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
    return input_ids, attention_mask, position_ids, token_lists


def check_token_range(token_lists: Sequence[Sequence[int]], vocab_size: int) -> None:
    """ValueError naming the first prompt row holding an id outside [0, vocab_size)."""
    for row, tokens in enumerate(token_lists):
        for token in tokens:
            if not 0 <= token < vocab_size:
                raise ValueError(f"prompt row {row} holds token id {token} outside [0, {vocab_size})")


def default_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """0-based positions of the real tokens of left-padded rows; padding gets 0."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def truncate_at_stop(tokens: Sequence[int], stop_token_ids: Collection[int]) -> list[int]:
    """`tokens` up to and including the first stop token (all of them when none occurs)."""
    tokens = list(tokens)
    if stop_token_ids:
        for i, token in enumerate(tokens):
            if token in stop_token_ids:
                return tokens[: i + 1]
    return tokens
