"""Left-padded prompt batches, the layout every rollout backend reads."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict


def left_padded_prompts(token_lists: Sequence[Sequence[int]], width: int | None = None, pad: int = 0,
                        position_ids: bool = False) -> TensorDict:
    """`input_ids` and `attention_mask` (B, width), each row's tokens at the right end (width defaults
    to the longest row; an empty row is all padding); `position_ids` counting real tokens from 0 too
    when asked."""
    width = max(len(t) for t in token_lists) if width is None else width
    ids = torch.full((len(token_lists), width), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, tokens in enumerate(token_lists):
        if len(tokens) > width:
            raise ValueError(f"row {i} has {len(tokens)} tokens, more than width={width}")
        if len(tokens):
            ids[i, width - len(tokens):] = torch.as_tensor(list(tokens), dtype=torch.int64)
            mask[i, width - len(tokens):] = 1
    fields = {"input_ids": ids, "attention_mask": mask}
    if position_ids:
        from ballast.workers.rollout.prompts import default_position_ids

        fields["position_ids"] = default_position_ids(mask)
    return TensorDict(fields, batch_size=[len(token_lists)])
