"""Widen batches to common prompt and response widths, so that batches of different rollout calls
concatenate (`concat_padded`).

A rollout call lays its samples out as a left-padded prompt of width P (the call's longest prompt)
followed by a right-padded response of width R (see `ballast.workers.agent_loop.output`). Two calls
rarely agree on P, so their batches cannot be stacked as they are. Widening a batch keeps every real
token where the layout wants it: prompt-side columns are added on the left, response-side columns on
the right, so the last prompt token stays next to the first response token and response column j is
still response token j. Which side a tensor belongs to comes from its canonical shape in
`ballast.protocol.fields` ("P", "R" or "P+R"); sample-only fields ("B") are left alone, and any other
tensor must already agree in width (`Batch.concat` names it otherwise).

Fill values follow the rollout's own padding: the pad token for token ids, -1 for the weight
versions of partial rollouts, 0 for masks and float fields, 0 for prompt-side positions and, on the
response side, positions that keep counting from the row's last one (as the rollout writes them
after a response's end).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ballast.protocol.batch import Batch
from ballast.protocol.fields import FIELDS

TOKEN_ID_KEYS = frozenset({"prompts", "responses", "input_ids"})
"""Tensors of token ids: widened with the pad token (every other field is widened with 0, but those of
`FILL_VALUES`)."""
FILL_VALUES = {"rollout_versions": -1}
"""Fields whose padding is not 0: the rollout marks a token that no weights sampled with version -1."""


def _widths(batch: Batch) -> tuple[int | None, int | None]:
    """(P, R) of a batch: from `prompts` / `responses`, or one of them from a full-sequence field."""
    prompt = int(batch["prompts"].shape[1]) if "prompts" in batch else None
    response = int(batch["responses"].shape[1]) if "responses" in batch else None
    full = next((int(batch[k].shape[1]) for k in batch.tensor_keys
                 if k in FIELDS and FIELDS[k].shape[1:] == ("P+R",)), None)
    if full is not None and (prompt is None) != (response is None):
        if prompt is None:
            prompt = full - response
        else:
            response = full - prompt
    return prompt, response


def _fill(key: str, tensor: torch.Tensor, columns: int, pad_token_id: int) -> torch.Tensor:
    shape = (tensor.shape[0], columns, *tensor.shape[2:])
    value = pad_token_id if key in TOKEN_ID_KEYS else FILL_VALUES.get(key, 0)
    return torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)


def _continued_positions(positions: torch.Tensor, columns: int) -> torch.Tensor:
    steps = torch.arange(1, columns + 1, dtype=positions.dtype, device=positions.device)
    return positions[:, -1:] + steps


def pad_to_widths(batch: Batch, prompt_width: int, response_width: int, pad_token_id: int) -> Batch:
    """`batch` with its prompt side widened to `prompt_width` columns (on the left) and its response
    side to `response_width` (on the right); a new Batch sharing the non-tensors and meta.

    ValueError when a width would shrink, or when the batch has full-sequence fields but neither
    `prompts` nor `responses` to tell where its prompt part ends.
    """
    prompt, response = _widths(batch)
    add_left = 0 if prompt is None else prompt_width - prompt
    add_right = 0 if response is None else response_width - response
    if add_left < 0 or add_right < 0:
        raise ValueError(f"cannot narrow a batch of prompt width {prompt} and response width {response} "
                         f"to {prompt_width} and {response_width}")
    if add_left == 0 and add_right == 0:
        return batch[:]
    tensors = {}
    for key, tensor in batch.tensors.items():
        side = FIELDS[key].shape[1:] if key in FIELDS else ()
        if side == ("P+R",) and (prompt is None or response is None):
            raise ValueError(f"cannot widen {key!r}: the batch has neither 'prompts' nor 'responses' "
                             "to tell its prompt part from its response part")
        left = add_left if side in (("P",), ("P+R",)) else 0
        right = add_right if side in (("R",), ("P+R",)) else 0
        parts = [_fill(key, tensor, left, pad_token_id)] if left else []
        parts.append(tensor)
        if right:
            parts.append(_continued_positions(tensor, right) if key == "position_ids"
                         else _fill(key, tensor, right, pad_token_id))
        tensors[key] = torch.cat(parts, dim=1) if len(parts) > 1 else tensor
    return Batch(tensors, batch.non_tensors, batch.meta)


def concat_padded(batches: Iterable[Batch], pad_token_id: int) -> Batch:
    """`Batch.concat` of batches whose prompt and response widths may differ: each is first widened
    to the widest prompt and the widest response among them (see the module docstring)."""
    batches = list(batches)
    if not batches:
        raise ValueError("concat_padded needs at least one Batch")
    widths = [_widths(b) for b in batches]
    prompt_width = max((p for p, _ in widths if p is not None), default=0)
    response_width = max((r for _, r in widths if r is not None), default=0)
    return Batch.concat([pad_to_widths(b, prompt_width, response_width, pad_token_id) for b in batches])
