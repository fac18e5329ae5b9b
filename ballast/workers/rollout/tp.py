"""Tensor-parallel rollout: all-gather the prompts of a TP group, generate once, return each rank its slice.

The driver dispatches prompts per rollout *DP rank*, but every TP rank of one vLLM engine must call
`generate` in lockstep with identical inputs. So, within a TP group (verl's all_gather_data_proto):
  1. every rank contributes its own prompts; counts and lengths may differ, so sizes are
     all-gathered first and each rank left-pads to the group's largest (rows, prompt length);
  2. the padded tensors are all-gathered and concatenated in rank order: every rank holds the same
     gathered batch (a digest of it and of the sampling config is compared across the group, so a
     mismatch is a clear error on every rank instead of a hang or silent garbage);
  3. all ranks generate the gathered batch together;
  4. each rank keeps exactly its own rows, in order, with its own prompt width restored.
TP groups are runs of consecutive global ranks, the layout vLLM's external_launcher uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from .base import RolloutBackend, SamplingConfig
from .postprocess import input_digest, read_prompts

PROMPT_WIDTH_KEYS = ("prompts",)
SEQUENCE_WIDTH_KEYS = ("input_ids", "attention_mask", "position_ids")


def tp_group_ranks(world_size: int, tp_size: int) -> list[list[int]]:
    """The TP groups of a world: [[0..tp-1], [tp..2tp-1], ...] (vLLM external_launcher layout)."""
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tensor_model_parallel_size={tp_size} must divide world_size={world_size}")
    return [list(range(start, start + tp_size)) for start in range(0, world_size, tp_size)]


def new_tp_group(tp_size: int, backend: str = "gloo") -> dist.ProcessGroup:
    """This rank's TP group. Collective: every rank of the world must call it, with the same tp_size.

    gloo by default: only small CPU tensors (prompt ids) travel on it, even on a GPU cluster.
    """
    mine = None
    for ranks in tp_group_ranks(dist.get_world_size(), tp_size):
        group = dist.new_group(ranks, backend=backend)
        if dist.get_rank() in ranks:
            mine = group
    return mine


@dataclass(frozen=True)
class TPGatherInfo:
    """What `split_rank_output` needs: this rank's position and every rank's (rows, prompt width)."""

    rank: int
    rows_per_rank: tuple[int, ...]
    prompt_len_per_rank: tuple[int, ...]

    @property
    def max_prompt_len(self) -> int:
        return max(self.prompt_len_per_rank)

    @property
    def row_offset(self) -> int:
        return sum(self.rows_per_rank[: self.rank])


def pad_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
    num_rows: int, width: int, pad_token_id: int,
) -> torch.Tensor:
    """Stack (ids, mask, positions) into one (3, num_rows, width) int64 tensor, left-padding columns
    and appending all-padding rows (mask 0) below. Pure."""
    rows, cols = input_ids.shape
    if rows > num_rows or cols > width:
        raise ValueError(f"cannot pad prompts of shape {(rows, cols)} down to {(num_rows, width)}")
    out = torch.zeros((3, num_rows, width), dtype=torch.int64)
    out[0].fill_(int(pad_token_id))
    out[0, :rows, width - cols:] = input_ids
    out[1, :rows, width - cols:] = attention_mask
    out[2, :rows, width - cols:] = position_ids
    return out


def merge_gathered(stacked: torch.Tensor, rows_per_rank: Sequence[int]) -> TensorDict:
    """(group, 3, max_rows, width) from the all-gather -> one prompts TensorDict, rank order. Pure."""
    parts = [stacked[r, :, :n] for r, n in enumerate(rows_per_rank)]
    merged = torch.cat(parts, dim=1)
    return TensorDict(
        {"input_ids": merged[0], "attention_mask": merged[1], "position_ids": merged[2]},
        batch_size=[merged.shape[1]],
    )


def split_rank_output(output: TensorDict, info: TPGatherInfo) -> TensorDict:
    """This rank's rows of the gathered output, with its original prompt width restored. Pure."""
    start = info.row_offset
    rows = info.rows_per_rank[info.rank]
    drop = info.max_prompt_len - info.prompt_len_per_rank[info.rank]
    local = {}
    for key, value in output.items():
        value = value[start:start + rows]
        if key in PROMPT_WIDTH_KEYS or key in SEQUENCE_WIDTH_KEYS:
            value = value[:, drop:]
        local[key] = value
    return TensorDict(local, batch_size=[rows])


# torch 2.13 renamed all_gather_into_tensor (output = inputs concatenated along dim 0).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _collective_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_prompts(prompts: TensorDict, group, pad_token_id: int) -> tuple[TensorDict, TPGatherInfo]:
    """All-gather the prompts of every rank of `group` (collective); see the module docstring.

    Invalid prompts on any rank raise ValueError on every rank (never a lone raise while the
    peers wait in the all-gather).
    """
    size = dist.get_world_size(group)
    device = _collective_device(group)
    try:
        input_ids, attention_mask, position_ids, _ = read_prompts(prompts)
        local_size = torch.tensor(list(input_ids.shape), dtype=torch.int64, device=device)
        error = None
    except ValueError as e:
        local_size = torch.tensor([-1, -1], dtype=torch.int64, device=device)
        error = e
    sizes = torch.empty(size * 2, dtype=torch.int64, device=device)
    _all_gather_single(sizes, local_size, group=group)
    sizes = sizes.view(size, 2).cpu()
    if error is not None:
        raise error
    bad = (sizes[:, 0] < 0).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"TP group ranks {bad} (group-local) passed invalid prompts; see their error")
    info = TPGatherInfo(
        rank=dist.get_rank(group),
        rows_per_rank=tuple(int(n) for n in sizes[:, 0]),
        prompt_len_per_rank=tuple(int(p) for p in sizes[:, 1]),
    )
    max_rows = max(info.rows_per_rank)
    padded = pad_prompts(input_ids, attention_mask, position_ids, max_rows, info.max_prompt_len, pad_token_id)
    stacked = torch.empty((size * padded.shape[0], *padded.shape[1:]), dtype=torch.int64, device=device)
    _all_gather_single(stacked, padded.to(device), group=group)
    return merge_gathered(stacked.view(size, *padded.shape).cpu(), info.rows_per_rank), info


def check_lockstep(gathered: TensorDict, sampling: SamplingConfig, group) -> str:
    """Compare a digest of (gathered prompts, sampling) across `group`; RuntimeError on every rank
    if they differ. Returns the digest."""
    _, _, _, token_lists = read_prompts(gathered)
    digest = input_digest(token_lists, repr(sampling))
    device = _collective_device(group)
    mine = torch.tensor([int(digest[:15], 16)], dtype=torch.int64, device=device)
    everyone = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    _all_gather_single(everyone, mine, group=group)
    if (everyone != mine).any():
        raise RuntimeError(
            f"TP ranks would generate different inputs (digests {everyone.tolist()}): "
            "the sampling config or the gathered prompts differ between ranks"
        )
    return digest


def tp_generate(
    backend: RolloutBackend, prompts: TensorDict, group, sampling: SamplingConfig | None = None,
    call_index: int | None = None,
) -> TensorDict:
    """Generate this rank's prompts with a TP engine: gather, lockstep check, generate, split.

    Collective over `group` (every rank calls it, with the same sampling config); `group=None` or a
    group of one rank just calls `backend.generate`. Returns exactly this rank's rows, in order.
    """
    if group is None or dist.get_world_size(group) == 1:
        return backend.generate(prompts, sampling, call_index)
    group_ranks = dist.get_process_group_ranks(group)
    engine_ranks = getattr(backend, "tp_group_ranks", None)
    if engine_ranks is not None and list(engine_ranks) != list(group_ranks):
        raise ValueError(f"TP group ranks {group_ranks} differ from the engine's TP group {list(engine_ranks)}")
    sampling = sampling or backend.config.sampling
    gathered, info = gather_prompts(prompts, group, backend.pad_token_id)
    check_lockstep(gathered, sampling, group)
    return split_rank_output(backend.generate(gathered, sampling, call_index), info)
