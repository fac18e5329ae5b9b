"""Fixed-shape micro-batches for the pipeline: one micro-batch packed into a slot of T tokens.

A pipeline stage is built for one activation shape, (1, T, hidden): torch.distributed.pipelining
allocates every receive buffer from it and keeps it, so a micro-batch of another shape would be read
into a stale buffer (smaller) or abort the process (larger, in gloo). Every micro-batch of a phase
is therefore packed into exactly ``slot_tokens`` positions: its rows' real tokens first, in row
order, then padding. What the stages need besides the activations travels as one keyword argument,
a :class:`Slot`: the packed position ids, the per-sequence attention context (``cu_seqlens``), how
many positions are real (a stage computes on those only and pads its output back to the slot), and,
for the last stage, which positions predict a response token and the labels there.

:func:`check_slots` is the shape guard every rank runs before a schedule starts: all ranks hold the
same slots, so a bad one makes every rank raise together, before any send or receive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from ballast.engine import padding
from ballast.engine.attention import PackedAttentionContext


@dataclass(frozen=True)
class HeadOptions:
    """What the last stage computes at the kept positions: log-probs (+ entropy) or values."""

    is_critic: bool
    temperature: float = 1.0
    calculate_entropy: bool = False
    chunk_tokens: int = 1024

    @property
    def output_rows(self) -> int:
        """Rows of the last stage's (rows, T) output: log-probs and entropy, or values."""
        return 1 if self.is_critic else 2


@dataclass(frozen=True, eq=False)
class Slot:
    """One micro-batch as every stage sees it (the ``slot`` keyword of a stage's forward)."""

    position_ids: torch.Tensor   # (1, T): packed positions, 0 over the padding
    attention: PackedAttentionContext
    num_tokens: int              # real tokens, packed at the front
    keep: torch.Tensor           # (N,) packed positions whose output predicts a response token
    labels: torch.Tensor         # (N,) the response tokens they predict
    head: HeadOptions

    @property
    def slot_tokens(self) -> int:
        return int(self.position_ids.shape[1])


@dataclass(frozen=True, eq=False)
class PackedMicroBatch:
    """A micro-batch ready for the pipeline: the first stage's input, the slot, and how its outputs
    map back to (rows, R)."""

    input_ids: torch.Tensor      # (1, T)
    slot: Slot
    rows: torch.Tensor           # the micro-batch's rows of the mini-batch
    response_slots: padding.ResponseSlots | None
    batch_size: int
    response_len: int


def pack_slot(micro: TensorDict, rows: torch.Tensor, slot_tokens: int, head: HeadOptions,
              attn_backend: str = "auto") -> PackedMicroBatch:
    """Pack ``micro`` (the padded layout, possibly no rows) into ``slot_tokens`` positions. A
    micro-batch with more real tokens than the slot is a ``ValueError`` (the hard cap)."""
    batch, response_len = micro["responses"].shape
    device = micro["input_ids"].device
    input_ids = torch.zeros(1, slot_tokens, dtype=torch.int64, device=device)
    position_ids = torch.zeros(1, slot_tokens, dtype=torch.int64, device=device)
    if batch == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        ctx = PackedAttentionContext(cu_seqlens=torch.zeros(1, dtype=torch.int32, device=device), max_seqlen=0,
                                     backend=attn_backend)
        slot = Slot(position_ids, ctx, 0, empty, empty, head)
        return PackedMicroBatch(input_ids, slot, rows, None, 0, response_len)
    slots = padding.response_slots(micro["attention_mask"], response_len)
    packed = padding.unpad(micro["input_ids"], micro["attention_mask"])
    n = packed.num_tokens
    if n > slot_tokens:
        raise ValueError(f"a micro-batch of {batch} rows holds {n} tokens, more than its pipeline slot of "
                         f"{slot_tokens} tokens")
    input_ids[0, :n] = packed.input_ids
    position_ids[0, :n] = micro["position_ids"].reshape(-1)[packed.flat_indices]
    ctx = PackedAttentionContext(cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen, backend=attn_backend)
    labels = micro["responses"][slots.rows, slots.cols]
    slot = Slot(position_ids, ctx, n, slots.packed_pos, labels, head)
    return PackedMicroBatch(input_ids, slot, rows, slots, batch, response_len)


def check_slots(micro_batches: list[PackedMicroBatch], slot_tokens: int) -> None:
    """Raise ``ValueError`` naming the first micro-batch whose tensors are not the shape the stages
    were built for: the schedule would read it into a stale buffer, or abort mid-step."""
    expected = (1, slot_tokens)
    for j, mb in enumerate(micro_batches):
        shapes = {"input_ids": tuple(mb.input_ids.shape), "position_ids": tuple(mb.slot.position_ids.shape)}
        bad = {name: shape for name, shape in shapes.items() if shape != expected}
        if bad:
            raise ValueError(f"pipeline micro-batch {j} has {bad}, but the stages were built for slots of shape "
                             f"{expected}: its activations would be read into buffers of another size")
        cu = mb.slot.attention.cu_seqlens
        if int(cu[-1]) != mb.slot.num_tokens or mb.slot.num_tokens > slot_tokens:
            raise ValueError(f"pipeline micro-batch {j} says {mb.slot.num_tokens} real tokens but its sequences "
                             f"end at {int(cu[-1])} (slot of {slot_tokens})")


def slot_outputs(output: torch.Tensor, mb: PackedMicroBatch) -> dict[str, torch.Tensor]:
    """The last stage's (rows, T) output of one micro-batch as {name: (B_micro, R)} (differentiable)."""
    head = mb.slot.head
    keep = mb.slot.keep
    if head.is_critic:
        named = {"values": output[0][keep]}
    else:
        named = {"log_probs": output[0][keep]}
        if head.calculate_entropy:
            named["entropy"] = output[1][keep]
    return {key: padding.scatter_response(v, mb.response_slots, mb.batch_size, mb.response_len)
            for key, v in named.items()}
