"""The rollout output contract, as pure functions: prompts in, prompt + response tensors out.

Input (one row per sample; the driver has already repeated prompts `n` times):
  input_ids (B, P) int64, LEFT-padded; attention_mask (B, P) 0 on padding then 1;
  position_ids (B, P) optional (default: cumsum(mask) - 1, clamped at 0).
Output TensorDict, batch size [B], rows in input order (dtypes as in `ballast.protocol.fields`):
  prompts (B, P)            the input ids unchanged
  responses (B, R)          generated ids, RIGHT-padded with the pad id
  response_mask (B, R)      1 on response tokens up to and including the first eos/stop token, 0 after
  input_ids (B, P+R)        prompts then responses
  attention_mask (B, P+R)   the prompt mask then the response mask
  position_ids (B, P+R)     the prompt's, then continuing from its last position: last + 1, last + 2, ...
  rollout_log_probs (B, R)  optional, float32, 0 on padding
R is the longest response of the call, or a fixed `response_length` (static shapes). A response
is cut after its first eos/stop token: engines that keep writing past it (HF generate pads
finished rows; sampling with ignore_eos does not stop) never leak tokens into the mask.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence

import torch
from tensordict import TensorDict


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


def build_rollout_output(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]] | None = None,
    *,
    pad_token_id: int,
    stop_token_ids: Collection[int] = (),
    response_length: int | None = None,
) -> TensorDict:
    """Assemble the output contract (see the module docstring) from prompts and generated ids."""
    _check_prompt_tensors(input_ids, attention_mask)
    num_rows, prompt_len = input_ids.shape
    if len(responses) != num_rows:
        raise ValueError(f"{len(responses)} responses for {num_rows} prompt rows")
    if log_probs is not None and len(log_probs) != num_rows:
        raise ValueError(f"{len(log_probs)} log-prob rows for {num_rows} prompt rows")
    if position_ids is None:
        position_ids = default_position_ids(attention_mask)
    elif position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
    stop = frozenset(int(t) for t in stop_token_ids)
    cut = [truncate_at_stop(r, stop) for r in responses]
    longest = max((len(r) for r in cut), default=0)
    width = longest if response_length is None else response_length
    if longest > width:
        row = max(range(num_rows), key=lambda i: len(cut[i]))
        raise ValueError(f"response row {row} has {len(cut[row])} tokens > response_length={width}")

    resp = torch.full((num_rows, width), int(pad_token_id), dtype=torch.int64)
    resp_mask = torch.zeros((num_rows, width), dtype=torch.int64)
    lps = torch.zeros((num_rows, width), dtype=torch.float32) if log_probs is not None else None
    for i, tokens in enumerate(cut):
        n = len(tokens)
        if n:
            resp[i, :n] = torch.tensor(tokens, dtype=torch.int64)
            resp_mask[i, :n] = 1
        if lps is not None:
            if len(log_probs[i]) < n:
                raise ValueError(f"response row {i}: {len(log_probs[i])} log-probs for {n} tokens")
            if n:
                lps[i, :n] = torch.tensor(list(log_probs[i][:n]), dtype=torch.float32)

    prompts = input_ids.to(torch.int64)
    prompt_pos = position_ids.to(torch.int64)
    steps = torch.arange(1, width + 1, dtype=torch.int64).unsqueeze(0)
    out = {
        "prompts": prompts,
        "responses": resp,
        "response_mask": resp_mask,
        "input_ids": torch.cat([prompts, resp], dim=1),
        "attention_mask": torch.cat([attention_mask.to(torch.int64), resp_mask], dim=1),
        "position_ids": torch.cat([prompt_pos, prompt_pos[:, -1:] + steps], dim=1),
    }
    if lps is not None:
        out["rollout_log_probs"] = lps
    return TensorDict(out, batch_size=[num_rows])


def input_digest(token_lists: Sequence[Sequence[int]], sampling_repr: str) -> str:
    """A short hash of exactly what an engine was asked to do: TP ranks must agree on it."""
    h = hashlib.sha256(sampling_repr.encode())
    for tokens in token_lists:
        h.update(len(tokens).to_bytes(4, "little"))
        h.update(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]
