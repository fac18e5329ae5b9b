"""Execute a micro-batch plan on one rank: check it, cut the mini-batch, restore the order.

The plan (`ballast.balance.MiniBatchPlan`) is made by `ballast.balance.plan_phase`, on the trainer's
driver for every phase of a step; the engine never plans for itself. `check_rank_plan` verifies the
invariants it relies on (this rank's rows each exactly once, every micro-batch within the hard token
cap; equal micro-batch counts over the DP group hold by the plan's construction), without raising
or communicating, so the caller agrees a failure over the DP group before any collective: every
rank then raises together instead of some waiting forever.

An engine used alone (under `torchrun`, each rank holding its own rows) plans with
`plan_rank_micro_batches`: it all-gathers the row lengths and calls the same `plan_phase` with the
ranks' rows as a fixed partition. An empty micro-batch in a plan (a rank holding fewer rows than the
agreed count) runs a zero-weight "dummy" step that issues the same collectives and adds exactly
zero gradient.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from ballast.balance import MicroBatchPolicy, MiniBatchPlan, inverse_permutation, plan_phase
from ballast.balance.shared_prompts import micro_batch_tokens as shared_micro_batch_tokens
from ballast.balance.workload import Workload
from ballast.engine.shared_prefix import row_prompts


def agree_max(values: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """Element-wise MAX of small integer vectors over `group` (identity without a process group)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def micro_batch_tokens(plan: MiniBatchPlan, data: TensorDict, lengths: np.ndarray) -> Callable[[np.ndarray], int]:
    """The tokens a micro-batch of `data` rows executes under `plan`: the rows' real tokens, or with
    shared prompts each distinct prompt once (`ballast.balance.shared_prompts`)."""
    if not plan.shared_prompts:
        return lambda rows: int(lengths[rows].sum())
    prompt_ids, prompt_lengths = row_prompts(data)
    return lambda rows: shared_micro_batch_tokens(lengths, prompt_lengths, prompt_ids, rows)


def check_rank_plan(plan: MiniBatchPlan, dp_size: int, dp_rank: int, lengths: np.ndarray,
                    tokens_of: Callable[[np.ndarray], int] | None = None) -> str | None:
    """What is wrong with `plan` for this rank's mini-batch of `lengths` (real tokens per row), or None.
    `tokens_of(rows)`: what a micro-batch executes (default: its rows' real tokens)."""
    if not isinstance(plan, MiniBatchPlan):
        return f"expected a MiniBatchPlan from ballast.balance.plan_phase, got {type(plan).__name__}"
    if plan.dp_size != dp_size:
        return f"the micro-batch plan has {plan.dp_size} ranks, the DP group has {dp_size}"
    counts = {len(rank) for rank in plan.micro_batches}
    if len(counts) != 1:
        return f"the micro-batch plan has unequal micro-batch counts per rank {sorted(counts)}"
    rank = plan.for_rank(dp_rank)
    flat = np.concatenate(rank) if rank else np.zeros(0, dtype=np.int64)
    num_rows = len(lengths)
    if flat.size != num_rows or (num_rows and (np.bincount(flat, minlength=num_rows) != 1).any()):
        return f"the micro-batch plan does not cover this rank's {num_rows} rows exactly once"
    if plan.token_budget is not None:
        for j, mb in enumerate(rank):
            tokens = int(lengths[mb].sum()) if tokens_of is None else tokens_of(mb)
            if tokens > plan.token_budget:
                return f"micro-batch {j} of DP rank {dp_rank} holds {tokens} tokens, over the budget {plan.token_budget}"
    return None


def plan_rank_micro_batches(lengths: np.ndarray, policy: MicroBatchPolicy, dp_group: dist.ProcessGroup | None,
                            prompt_lengths: np.ndarray | None = None, workload: Workload = "tokens") -> MiniBatchPlan:
    """The plan of one mini-batch whose rows are already placed (rank r holds its own rows), for an
    engine used without the trainer's driver. Collective over `dp_group` (an all-gather of lengths)."""
    local = (np.asarray(lengths, dtype=np.int64), None if prompt_lengths is None else np.asarray(prompt_lengths))
    if dp_group is None or not dist.is_initialized() or dist.get_world_size(dp_group) == 1:
        gathered = [local]
    else:
        gathered = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(gathered, local, group=dp_group)
    sizes = np.cumsum([0] + [len(g[0]) for g in gathered])
    partitions = [np.arange(sizes[r], sizes[r + 1]) for r in range(len(gathered))]
    prompts = None if local[1] is None else np.concatenate([g[1] for g in gathered])
    plan = plan_phase(np.concatenate([g[0] for g in gathered]), len(gathered), policy, workload=workload,
                      prompt_lengths=prompts, partitions=partitions)
    return plan.mini_batches[0]


def restore_index(micro_batches: tuple[np.ndarray, ...]) -> np.ndarray:
    """`concat(outputs of the micro-batches)[restore_index(...)]` is in input row order."""
    if not micro_batches:
        return np.zeros(0, dtype=np.int64)
    return inverse_permutation(np.concatenate(micro_batches))


def restore_order(outputs: list[torch.Tensor], micro_batches: tuple[np.ndarray, ...]) -> torch.Tensor:
    """Concatenate per-micro-batch outputs (rows in plan order) and put rows back in input order."""
    if not outputs:
        raise ValueError("restore_order needs at least one micro-batch output")
    cat = torch.cat(outputs, dim=0)
    index = torch.as_tensor(restore_index(micro_batches), device=cat.device)
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
