"""Micro-batches for a pipeline-parallel engine: fixed slots, counts the schedule runs, a planned order.

A pipeline engine hands all of a mini-batch's micro-batches to one schedule, whose stages were built
for one shape: every micro-batch of the mini-batch travels in a slot of exactly ``slot_tokens``
tokens, the plan's largest micro-batch rounded up to :data:`SLOT_QUANTUM` (for token-budget cuts at
most the budget). A slot fitted to the plan instead of the budget itself keeps the padding small
whatever the count (measured in docs/benchmarks.md); a new slot size costs the engine one more set of
stages, built from the slot's shape with no forward to infer it (torch's static stages), kept for reuse.
The plan keeps:

* the hard token cap: no micro-batch holds more real tokens than the budget, nor than its slot;
* equal counts on every DP rank (a rank with fewer rows than the count gets empty micro-batches,
  which travel as slots of padding and add nothing);
* at least as many micro-batches as pipeline ranks, and a count the schedule accepts: a multiple of
  ``microbatch_group_size_per_vp_stage`` under virtual stages, and of the rounds of torch's
  interleaved schedules (:meth:`ballast.balance.pipeline.PipelineShape.count_error`).

The count (token-budget cuts) is chosen with the cost model: the smallest valid count, and larger
valid ones up to :data:`_COUNT_GROWTH` times it, each costed by simulating its pipeline on every DP
rank (the ranks run their pipelines independently and meet at the gradient all-reduce, so a
candidate costs its slowest rank); more micro-batches shrink the bubble but pay every layer's
per-pass overhead and the slot transfers once more. Each rank's micro-batches are then put in the
order the simulator finds fastest (:func:`ballast.balance.pipeline_cost.order_micro_batches`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .micro_batch import min_micro_batches, plan_dynamic_micro_batches
from .pipeline_cost import MicroBatchWork, PipelineCostModel, order_micro_batches, pyramid_order
from .workload import Workload

# Slots are rounded up to a multiple of this many tokens: a step whose largest micro-batch grew by a
# few tokens reuses the stages built for the previous one, at most 15 padded tokens per micro-batch.
SLOT_QUANTUM = 16
# Token-budget cuts try counts up to this multiple of the smallest valid one.
_COUNT_GROWTH = 2
_MAX_COUNT_CANDIDATES = 6


def fitted_slot_tokens(tokens: list[np.ndarray], micro: list[list[np.ndarray]], cap: Optional[int] = None) -> int:
    """The slot of these micro-batches: their largest token sum rounded up to ``SLOT_QUANTUM``, at
    most ``cap`` (the token budget, which no micro-batch exceeds)."""
    largest = max((int(t[mb].sum()) for t, rank in zip(tokens, micro) for mb in rank), default=0)
    slot = max(SLOT_QUANTUM, -(-largest // SLOT_QUANTUM) * SLOT_QUANTUM)
    return slot if cap is None else min(slot, int(cap))


def _works(tokens: np.ndarray, micro: list[np.ndarray], response_tokens: Optional[np.ndarray]) -> list[MicroBatchWork]:
    return [MicroBatchWork.of(tokens[mb], None if response_tokens is None else response_tokens[mb]) for mb in micro]


def _pad_to(micro: list[np.ndarray], count: int) -> list[np.ndarray]:
    empty = np.zeros(0, dtype=np.int64)
    return list(micro) + [empty] * (count - len(micro))


def _dynamic_cut(tokens: np.ndarray, budget: int, count: int, workload: Workload) -> list[np.ndarray]:
    if not len(tokens):
        return _pad_to([], count)
    return _pad_to(plan_dynamic_micro_batches(tokens, budget, min(count, len(tokens)), workload), count)


def _count_candidates(model: PipelineCostModel, smallest: int, most_rows: int) -> list[int]:
    """Valid counts from the smallest upward, at most ``_COUNT_GROWTH`` times it and no more than one
    non-empty micro-batch per row of the fullest rank (beyond that only empty slots would be added)."""
    counts = [model.shape.valid_count(smallest)]
    limit = max(counts[0], min(_COUNT_GROWTH * counts[0], most_rows))
    while len(counts) < _MAX_COUNT_CANDIDATES:
        nxt = model.shape.valid_count(counts[-1] + 1)
        if nxt > limit:
            break
        counts.append(nxt)
    return counts


def plan_pipeline_micro_batches(tokens: list[np.ndarray], model: PipelineCostModel, *, token_budget: Optional[int],
                                micro_batch_size: Optional[int], workload: Workload = "tokens",
                                response_tokens: Optional[list[np.ndarray]] = None
                                ) -> tuple[list[list[np.ndarray]], int, dict]:
    """Each DP rank's micro-batches (row positions into its ``tokens``), in execution order, the
    slot every one travels in, and plan metrics. Exactly one of ``token_budget`` (token-budget cut)
    and ``micro_batch_size`` (static cut) is given; ``response_tokens`` (per rank, optional) say
    where the output head runs."""
    most_rows = max(len(t) for t in tokens)
    if token_budget is not None:
        smallest = max(min_micro_batches(t, token_budget) if len(t) else 0 for t in tokens)
        candidates = [(count, [_dynamic_cut(t, int(token_budget), count, workload) for t in tokens])
                      for count in _count_candidates(model, smallest, most_rows)]
    else:
        chunks = [[np.arange(s, min(s + micro_batch_size, len(t)), dtype=np.int64)
                   for s in range(0, len(t), micro_batch_size)] for t in tokens]
        count = model.shape.valid_count(max(len(c) for c in chunks))
        candidates = [(count, [_pad_to(c, count) for c in chunks])]
    responses = response_tokens or [None] * len(tokens)
    best = None
    for count, micro in candidates:
        # Each candidate costed in its pyramid order (one simulation per rank); the winner is then ordered.
        works = [_works(t, rank, r) for t, rank, r in zip(tokens, micro, responses)]
        cost = max(model.simulate(w, pyramid_order(model.stage_costs(w)[0].sum(axis=0))).step_time for w in works)
        if best is None or cost < best[0]:
            best = (cost, count, micro, works)
    _, count, micro, works = best
    slot = fitted_slot_tokens(tokens, micro, token_budget)
    ordered, timelines = [], []
    for rank, rank_works in zip(micro, works):
        order, timeline = order_micro_batches(model, rank_works)
        ordered.append([rank[j] for j in order])
        timelines.append(timeline)
    real = sum(int(t.sum()) for t in tokens)
    metrics = {
        "plan/pp_num_micro_batches_min": float(candidates[0][0]),
        "plan/pp_bubble_fraction_predicted": float(np.mean([t.bubble_fraction for t in timelines])),
        "plan/pp_slot_fill": real / float(count * slot * len(tokens)),
        "plan/pp_slot_tokens": float(slot),
    }
    return ordered, slot, metrics
