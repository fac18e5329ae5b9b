"""Pure helpers between the padded batch layout and the packed ("remove padding") layout.

Padded layout (what the engine receives): `input_ids`, `attention_mask`, `position_ids` of shape
(B, S) with S = P + R, prompts left-padded into the first P columns and responses right-padded into
the last R columns, so each row's real tokens are one contiguous run that ends the prompt at column
P - 1. The log-prob (or value) of response token j is read from the model output at column P - 1 + j.

Packed layout: the real tokens of all rows concatenated in row order into one (T,) sequence,
`cu_seqlens` (B + 1,) marking where each row starts, position ids restarting at 0 for every row.
Nothing here touches a model or a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedBatch:
    """The real tokens of a padded (B, S) batch packed into one sequence of T tokens."""

    input_ids: torch.Tensor  # (T,)
    position_ids: torch.Tensor  # (T,) restarting at 0 per row
    flat_indices: torch.Tensor  # (T,) index of each packed token in the flattened (B * S) layout
    cu_seqlens: torch.Tensor  # (B + 1,) int32, row b is packed[cu_seqlens[b]:cu_seqlens[b + 1]]
    max_seqlen: int
    batch_size: int
    seq_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def sequence_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """Real tokens per row, (B,) int64."""
    return attention_mask.to(torch.int64).sum(dim=-1)


def check_padded_layout(attention_mask: torch.Tensor, response_len: int) -> None:
    """Raise ValueError unless every row is one contiguous run of real tokens covering column P - 1.

    Packing joins a row's real tokens; a hole in the mask would silently glue two pieces together, and a
    row whose prompt column P - 1 is padding has no position to predict its first response token from.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D (B, S), got shape {tuple(attention_mask.shape)}")
    batch, seq_len = attention_mask.shape
    prompt_len = seq_len - response_len
    if response_len < 1 or prompt_len < 1:
        raise ValueError(
            f"need at least one prompt and one response column: attention_mask has S={seq_len} columns, "
            f"responses have R={response_len}"
        )
    mask = attention_mask.to(torch.bool)
    lengths = mask.sum(dim=-1)
    cols = torch.arange(seq_len, device=mask.device).expand(batch, seq_len)
    first = torch.where(mask, cols, seq_len).min(dim=-1).values
    last = torch.where(mask, cols, -1).max(dim=-1).values
    holes = (lengths > 0) & (last - first + 1 != lengths)
    if bool(holes.any()):
        row = int(holes.nonzero()[0, 0])
        raise ValueError(
            f"attention_mask row {row} is not one contiguous run of real tokens "
            f"({int(lengths[row])} real tokens between columns {int(first[row])} and {int(last[row])})"
        )
    no_prompt_end = ~mask[:, prompt_len - 1]
    if bool(no_prompt_end.any()):
        row = int(no_prompt_end.nonzero()[0, 0])
        raise ValueError(
            f"attention_mask row {row} has padding at the last prompt column P-1={prompt_len - 1}: "
            "prompts must be left-padded and non-empty"
        )


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedBatch:
    """Pack the real tokens of (B, S) `input_ids` into one sequence, rows in order."""
    batch, seq_len = input_ids.shape
    mask_flat = attention_mask.reshape(-1).to(torch.bool)
    flat_indices = mask_flat.nonzero().squeeze(-1)
    lengths = sequence_lengths(attention_mask)
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = torch.cumsum(lengths, dim=0).to(torch.int32)
    max_seqlen = int(lengths.max()) if batch > 0 else 0
    return PackedBatch(
        input_ids=input_ids.reshape(-1)[flat_indices],
        position_ids=packed_position_ids(cu_seqlens),
        flat_indices=flat_indices,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        batch_size=batch,
        seq_len=seq_len,
    )


def packed_position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(T,) positions 0..len-1 for every packed row described by `cu_seqlens`."""
    cu = cu_seqlens.to(torch.int64)
    total = int(cu[-1])
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    return torch.arange(total, device=cu.device) - starts


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(num_seqs + 1,) int32 boundaries of a packed (T,) sequence whose positions restart at 0."""
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().squeeze(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([torch.zeros(1, dtype=starts.dtype, device=pos.device), starts])
    end = torch.tensor([pos.numel()], dtype=starts.dtype, device=pos.device)
    return torch.cat([starts, end]).to(torch.int32)


def pad_back(packed: torch.Tensor, flat_indices: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """Scatter (T, ...) packed values into zeros of shape (B, S, ...) (differentiable)."""
    out = packed.new_zeros((batch * seq_len, *packed.shape[1:]))
    out = out.index_copy(0, flat_indices, packed)
    return out.reshape(batch, seq_len, *packed.shape[1:])


@dataclass(frozen=True)
class ResponseSlots:
    """Where each real response token's prediction lives, for both layouts.

    `rows`, `cols` (N,): the (b, j) response slots whose token is real. `padded_pos` (N,): the flat
    (b * S + P - 1 + j) position of the output that predicts it. `packed_pos` (N,): the same position in
    the packed sequence.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    padded_pos: torch.Tensor
    packed_pos: torch.Tensor
    valid: torch.Tensor  # (B, R) bool: response token is a real token


def response_slots(attention_mask: torch.Tensor, response_len: int) -> ResponseSlots:
    """Locate the output position that predicts every real response token."""
    batch, seq_len = attention_mask.shape
    prompt_len = seq_len - response_len
    mask = attention_mask.to(torch.bool)
    valid = mask[:, prompt_len:]
    rows, cols = valid.nonzero(as_tuple=True)
    padded_pos = rows * seq_len + prompt_len - 1 + cols
    # Packed index of a padded position = number of real tokens before it in row-major order.
    packed_index_of = torch.cumsum(mask.reshape(-1).to(torch.int64), dim=0) - 1
    return ResponseSlots(
        rows=rows,
        cols=cols,
        padded_pos=padded_pos,
        packed_pos=packed_index_of[padded_pos],
        valid=valid,
    )


def scatter_response(values: torch.Tensor, slots: ResponseSlots, batch: int, response_len: int) -> torch.Tensor:
    """Place (N,) per-slot values into a zero (B, R) tensor (differentiable)."""
    out = values.new_zeros(batch * response_len)
    out = out.index_copy(0, slots.rows * response_len + slots.cols, values)
    return out.reshape(batch, response_len)
