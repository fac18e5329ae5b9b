"""Cut one rank's mini-batch into micro-batches, agree the count over DP, restore the order.

Static: chunks of `micro_batch_size_per_gpu` rows. Dynamic: token-capped micro-batches planned by
`ballast.balance` with a budget of `max_token_len_per_gpu * sp_size` real tokens.

Every rank of the FSDP mesh must run the same number of forward/backward passes (each one all-gathers
and reduce-scatters over all ranks). The count is therefore agreed with an all-reduce MAX over the
explicitly passed DP group (SP peers hold the same data and plan the same). A rank that then has
fewer samples than the agreed count runs its samples one per micro-batch plus zero-weight "dummy"
micro-batches, which issue the same collectives and add exactly zero gradient. Planning errors (a
sample over the token budget, an indivisible static split) are agreed the same way, so all ranks
raise together instead of some waiting forever in the next collective.

A caller that planned the whole mini-batch centrally (the trainer's driver does, see
`ballast.balance.plan_step`) passes that plan instead: `explicit_plan` checks it and takes this
rank's micro-batches from it. Its counts are equal by construction, so no count all-reduce is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from ballast.balance import (
    bucket_ids,
    inverse_permutation,
    min_bucketed_micro_batches,
    min_micro_batches,
    plan_bucketed_micro_batches,
    plan_dynamic_micro_batches,
    plan_static_micro_batches,
)
from ballast.balance.workload import Workload
from ballast.engine.config import MicroBatchSpec


@dataclass(frozen=True)
class MicroBatchPlan:
    """Row indices of each real micro-batch, plus how many dummy micro-batches follow them."""

    micro_indices: list[np.ndarray]
    num_dummy: int

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_indices) + self.num_dummy

    def restore_index(self) -> np.ndarray:
        """`concat(outputs of real micro-batches)[restore_index()]` is in input row order."""
        if not self.micro_indices:
            return np.zeros(0, dtype=np.int64)
        return inverse_permutation(np.concatenate(self.micro_indices))


def _local_plan(lengths: np.ndarray, spec: MicroBatchSpec, sp_size: int,
                buckets: np.ndarray | None) -> tuple[int, str | None]:
    """(micro-batches this rank needs, error message or None), without raising."""
    num_rows = len(lengths)
    try:
        if spec.use_dynamic_bsz:
            if num_rows == 0:
                return 0, None
            if buckets is not None:
                return min_bucketed_micro_batches(lengths, buckets, spec.token_budget(sp_size)), None
            return min_micro_batches(lengths, spec.token_budget(sp_size)), None
        return len(plan_static_micro_batches(num_rows, spec.micro_batch_size_per_gpu)), None
    except (ValueError, TypeError) as exc:
        return 0, str(exc)


def agree_max(values: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """Element-wise MAX of small integer vectors over `group` (identity without a process group)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def plan_micro_batches(
    lengths: np.ndarray,
    spec: MicroBatchSpec,
    sp_size: int,
    dp_group: dist.ProcessGroup | None,
    device: torch.device = torch.device("cpu"),
    prompt_lengths: np.ndarray | None = None,
    workload: Workload = "tokens",
) -> MicroBatchPlan:
    """Plan this rank's micro-batches so that every rank of `dp_group` runs the same number.

    `lengths` are the real-token counts of this rank's rows; `prompt_lengths` their prompt parts,
    needed when `spec.bucket_boundaries` is set. Dynamic micro-batches are balanced by `workload`
    (the engine passes its model's FLOPs model) under the token cap. Collective over `dp_group`.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    buckets = None
    if spec.use_dynamic_bsz and spec.bucket_boundaries is not None:
        if prompt_lengths is None:
            raise ValueError("length bucketing needs the prompt lengths of the rows")
        buckets = bucket_ids(prompt_lengths, spec.bucket_boundaries)
    local_count, error = _local_plan(lengths, spec, sp_size, buckets)
    agreed_count, any_error = agree_max([local_count, int(error is not None)], dp_group, device)
    if any_error:
        where = f"this rank: {error}" if error else "another DP rank failed to plan its micro-batches"
        raise ValueError(f"micro-batch planning failed ({where})")
    num_rows = len(lengths)
    if spec.use_dynamic_bsz:
        real = min(agreed_count, num_rows)
        budget = spec.token_budget(sp_size)
        if not real:
            micro = []
        elif buckets is not None:
            micro = plan_bucketed_micro_batches(lengths, buckets, budget, num_micro_batches=real, workload=workload)
        else:
            micro = plan_dynamic_micro_batches(lengths, budget, num_micro_batches=real, workload=workload)
    else:
        micro = plan_static_micro_batches(num_rows, spec.micro_batch_size_per_gpu)
    return MicroBatchPlan(micro_indices=micro, num_dummy=agreed_count - len(micro))


def _plan_error(plan, dp_size: int, dp_rank: int, lengths: np.ndarray, budget: int | None) -> str | None:
    """What is wrong with a central plan (identical on every rank for the structural checks)."""
    if not isinstance(plan, (list, tuple)) or len(plan) != dp_size:
        size = len(plan) if isinstance(plan, (list, tuple)) else type(plan).__name__
        return f"micro-batch plan has {size} ranks, the DP group has {dp_size}"
    counts = [len(rank) for rank in plan]
    if len(set(counts)) != 1:
        return f"micro-batch plan has unequal micro-batch counts per rank {counts}; lockstep needs equal counts"
    for r, rank in enumerate(plan):
        arrays = [np.asarray(mb).reshape(-1) for mb in rank]
        if any(a.size == 0 for a in arrays):
            return f"micro-batch plan: rank {r} has an empty micro-batch"
        if any(not np.issubdtype(a.dtype, np.integer) for a in arrays):
            return f"micro-batch plan: rank {r} has non-integer row indices"
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        num_rows = len(lengths) if r == dp_rank else flat.size
        if r == dp_rank and flat.size != num_rows:
            return f"micro-batch plan: rank {r} covers {flat.size} rows but holds {num_rows}"
        seen = np.bincount(flat, minlength=num_rows) if flat.size and flat.min() >= 0 else None
        if seen is None or len(seen) != num_rows or (seen != 1).any():
            return f"micro-batch plan: rank {r}'s row indices are not each of 0..{num_rows - 1} exactly once"
    if budget is not None:
        for j, mb in enumerate(plan[dp_rank]):
            tokens = int(lengths[np.asarray(mb, dtype=np.int64)].sum())
            if tokens > budget:
                return (f"micro-batch plan: rank {dp_rank}'s micro-batch {j} holds {tokens} tokens, "
                        f"over the budget {budget}")
    return None


def explicit_plan(plan, spec: MicroBatchSpec, sp_size: int, dp_size: int, dp_rank: int,
                  lengths: np.ndarray) -> tuple[MicroBatchPlan | None, str | None]:
    """(this rank's part of a central plan `plan[r][j]` = rank r's row indices of its j-th
    micro-batch, None) or (None, what is wrong with it). Never raises and never communicates, so the
    caller can agree the error with its other preflight checks before any collective."""
    if spec.bucket_boundaries is not None:
        return None, "an explicit micro-batch plan cannot be combined with length bucketing (bucket_boundaries)"
    budget = spec.token_budget(sp_size) if spec.use_dynamic_bsz else None
    error = _plan_error(plan, dp_size, dp_rank, np.asarray(lengths, dtype=np.int64), budget)
    if error is not None:
        return None, error
    micro = [np.asarray(mb, dtype=np.int64).reshape(-1) for mb in plan[dp_rank]]
    return MicroBatchPlan(micro_indices=micro, num_dummy=0), None


def split_micro_batches(data: TensorDict, plan: MicroBatchPlan) -> list[TensorDict]:
    """The real micro-batches of `data` as TensorDicts, in plan order."""
    return [data[torch.as_tensor(idx, dtype=torch.int64)] for idx in plan.micro_indices]


def restore_order(outputs: list[torch.Tensor], plan: MicroBatchPlan) -> torch.Tensor:
    """Concatenate per-micro-batch outputs (rows in plan order) and put rows back in input order."""
    if not outputs:
        raise ValueError("restore_order needs at least one micro-batch output")
    cat = torch.cat(outputs, dim=0)
    index = torch.as_tensor(plan.restore_index(), device=cat.device)
    if index.numel() != cat.shape[0]:
        raise ValueError(f"plan covers {index.numel()} rows but outputs have {cat.shape[0]}")
    return cat[index]


def dummy_micro_batch(seq_len: int, response_len: int, device: torch.device) -> TensorDict:
    """A one-row micro-batch with 2 real tokens (last prompt column and first response column).

    Run with zero weight, it exercises the same layers and collectives as a real micro-batch.
    """
    prompt_len = seq_len - response_len
    input_ids = torch.zeros(1, seq_len, dtype=torch.int64, device=device)
    attention_mask = torch.zeros(1, seq_len, dtype=torch.int64, device=device)
    attention_mask[0, prompt_len - 1 : prompt_len + 1] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "responses": input_ids[:, prompt_len:].clone(),
            "response_mask": attention_mask[:, prompt_len:].clone(),
        },
        batch_size=[1],
        device=device,
    )
