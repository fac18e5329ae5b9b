"""Pipeline schedules as data: which stage runs which micro-batch when, and what that costs.

A pipeline of ``pp`` ranks holds ``pp * v`` stages (``v`` virtual stages per rank, stage ``s`` on
rank ``s % pp``: the loop placement of torch.distributed.pipelining's interleaved schedules). Each
rank executes a fixed sequence of actions (:func:`rank_orders`): ``F`` (forward of one micro-batch
through one stage), ``B`` (its whole backward), or, in the zero-bubble schedule, ``I`` (the backward
to the stage's input, what the previous stage waits for) and ``W`` (the weight gradients, which
nothing waits for and which fill the bubbles). The sequences are those the torch schedules execute
(``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``, torch 2.13; a
unit test compares them with torch's own ``pipeline_order``).

:func:`simulate` plays the sequences against per-stage, per-micro-batch costs: an action starts when
its rank is free and its inputs exist (the previous stage's forward of the micro-batch, the next
stage's backward of it, plus ``p2p_cost`` when they sit on another rank), as the schedules block on
their receives. Its bubble fraction is the mean over ranks of the time a rank waits divided by the
step time, the quantity the engine measures from the stages' own timelines. With equal costs it is
:func:`bubble_formula`'s ``(p - 1) / (v m + p - 1)``.

Pure numpy and the standard library; no torch.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import NamedTuple, Optional, Sequence

import numpy as np


class PipelineScheduleKind(str, enum.Enum):
    """The schedules the pipeline engine runs (torch.distributed.pipelining's classes)."""

    ONE_F_ONE_B = "1f1b"                   # Schedule1F1B: one stage per rank
    INTERLEAVED_1F1B = "interleaved_1f1b"  # ScheduleInterleaved1F1B: v stages per rank
    ZERO_BUBBLE = "zero_bubble"            # ScheduleInterleavedZeroBubble (ZB1P): backward split in I and W

    def __str__(self) -> str:
        return self.value


SCHEDULE_KINDS: tuple[str, ...] = tuple(k.value for k in PipelineScheduleKind)


@dataclasses.dataclass(frozen=True)
class PipelineShape:
    """``pp_size`` pipeline ranks, ``virtual_stages`` stages per rank, the schedule, and verl's
    ``microbatch_group_size_per_vp_stage`` (None: ``pp_size``, the only round size torch's
    interleaved schedules run; used only with virtual stages, where the micro-batch count must be
    a multiple of it)."""

    pp_size: int
    virtual_stages: int = 1
    schedule: PipelineScheduleKind = PipelineScheduleKind.ONE_F_ONE_B
    microbatch_group_size: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("pp_size", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"pipeline {name} must be a positive integer, got {value!r}")
        if self.pp_size < 2:
            raise ValueError(f"a pipeline needs pp_size >= 2, got {self.pp_size} (pp_size=1 is no pipeline)")
        try:
            object.__setattr__(self, "schedule", PipelineScheduleKind(self.schedule))
        except ValueError:
            raise ValueError(f"pipeline schedule must be one of {SCHEDULE_KINDS}, got {self.schedule!r}") from None
        if self.schedule is PipelineScheduleKind.ONE_F_ONE_B and self.virtual_stages != 1:
            raise ValueError(f"the {self.schedule} schedule runs one stage per rank; virtual_stages="
                             f"{self.virtual_stages} needs schedule 'interleaved_1f1b' or 'zero_bubble'")
        group = self.microbatch_group_size
        if group is not None and (isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1):
            raise ValueError(f"microbatch_group_size_per_vp_stage must be a positive integer or null, got {group!r}")
        if group is not None and self.virtual_stages > 1 and group != self.pp_size:
            raise ValueError(
                f"microbatch_group_size_per_vp_stage={group} with virtual stages: torch.distributed.pipelining's "
                f"interleaved schedules run micro-batches in rounds of pp_size={self.pp_size}; set it to "
                f"{self.pp_size} or null")

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.virtual_stages

    @property
    def count_multiple(self) -> int:
        """Micro-batch counts must be multiples of this (verl's VPP rule; 1 without virtual stages)."""
        if self.virtual_stages == 1:
            return 1
        return int(self.microbatch_group_size or self.pp_size)

    def rank_of(self, stage: int) -> int:
        return stage % self.pp_size

    def count_error(self, num_micro_batches: int) -> Optional[str]:
        """Why ``num_micro_batches`` cannot run through this pipeline, or None."""
        m = num_micro_batches
        if m < self.pp_size:
            return f"{m} micro-batches are fewer than the pipeline's {self.pp_size} ranks"
        if m % self.count_multiple:
            return (f"{m} micro-batches are not a multiple of microbatch_group_size_per_vp_stage="
                    f"{self.count_multiple} (virtual pipeline stages)")
        rounds = max(1, m // self.pp_size)
        if self.schedule is not PipelineScheduleKind.ONE_F_ONE_B and m % rounds:
            return (f"{m} micro-batches are not a multiple of the {rounds} rounds of the {self.schedule} schedule "
                    f"(rounds = micro-batches // pp_size={self.pp_size})")
        return None

    def valid_count(self, at_least: int) -> int:
        """The smallest micro-batch count >= ``at_least`` this pipeline runs."""
        m = max(int(at_least), self.pp_size)
        while self.count_error(m):
            m += 1
        return m


class Action(NamedTuple):
    """One unit of a rank's work: ``kind`` F, B, I or W of micro-batch ``micro`` on ``stage``."""

    kind: str
    stage: int
    micro: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro}"


def _one_f_one_b(shape: PipelineShape, m: int) -> list[list[Action]]:
    """Schedule1F1B: stage s runs min(m, p - s) forwards, then alternates backward and forward."""
    orders = []
    for s in range(shape.pp_size):
        warmup = min(m, shape.pp_size - s)
        acts = [Action("F", s, j) for j in range(warmup)]
        for j in range(m - warmup):
            acts += [Action("B", s, j), Action("F", s, warmup + j)]
        acts += [Action("B", s, j) for j in range(m - warmup, m)]
        orders.append(acts)
    return orders


def _interleaved(shape: PipelineShape, m: int, zero_bubble: bool) -> list[list[Action]]:
    """The flexible interleaved schedules: rounds of ``m // rounds`` micro-batches per local stage,
    ``rounds = max(1, m // p)``; a warm-up of forwards, then one forward and one backward (I under
    zero bubble) per step, then the remaining backwards; zero bubble adds each W once the rank is
    ``rank`` backwards into its steady state, the oldest first."""
    p, v = shape.pp_size, shape.virtual_stages
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(f"the interleaved schedules need the micro-batch count {m} to be a multiple of {rounds}")
    per_round = m // rounds
    total = v * m
    orders = []
    for rank in range(p):
        factor = 1 if zero_bubble else 2
        warmup = min((v - 1) * per_round + factor * (p - 1 - rank), total)

        def fwd_stage(op: int) -> int:
            return ((op // per_round) % v) * p + rank

        def bwd_stage(op: int) -> int:
            return (v - 1 - ((op - warmup) // per_round) % v) * p + rank

        next_mb: dict[tuple[str, int], int] = {}

        def act(kind: str, stage: int) -> Action:
            j = next_mb.get((kind, stage), 0)
            next_mb[(kind, stage)] = j + 1
            return Action(kind, stage, j)

        acts: list[Action] = []
        backward_ops: list[int] = []
        weights_done = 0
        for op in range(total + warmup):
            if op < total:
                acts.append(act("F", fwd_stage(op)))
            if op < warmup:
                continue
            acts.append(act("I" if zero_bubble else "B", bwd_stage(op)))
            backward_ops.append(op)
            if zero_bubble and op - warmup >= rank:
                acts.append(act("W", bwd_stage(backward_ops[weights_done])))
                weights_done += 1
        while zero_bubble and weights_done < len(backward_ops):
            acts.append(act("W", bwd_stage(backward_ops[weights_done])))
            weights_done += 1
        orders.append(acts)
    return orders


@functools.lru_cache(maxsize=256)
def rank_orders(shape: PipelineShape, num_micro_batches: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's action sequence for ``num_micro_batches`` micro-batches (checked by
    :meth:`PipelineShape.count_error`), as the torch schedule executes it."""
    error = shape.count_error(num_micro_batches)
    if error:
        raise ValueError(f"{error}: the {shape.schedule} schedule cannot run them")
    if shape.schedule is PipelineScheduleKind.ONE_F_ONE_B:
        orders = _one_f_one_b(shape, num_micro_batches)
    else:
        orders = _interleaved(shape, num_micro_batches, shape.schedule is PipelineScheduleKind.ZERO_BUBBLE)
    return tuple(tuple(acts) for acts in orders)


@dataclasses.dataclass(frozen=True)
class PipelineTimeline:
    """A simulated (or measured) step: when each action ran on each rank, in cost units.

    ``step_time``: the end of the last action. ``busy[r]``: rank r's computing time.
    ``bubble_fraction``: mean over ranks of ``(step_time - busy[r]) / step_time``.
    """

    step_time: float
    busy: tuple[float, ...]
    events: tuple[tuple[int, Action, float, float], ...] = ()  # (rank, action, start, end)

    @property
    def rank_bubbles(self) -> tuple[float, ...]:
        if self.step_time <= 0:
            return tuple(0.0 for _ in self.busy)
        return tuple(max(0.0, self.step_time - b) / self.step_time for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        bubbles = self.rank_bubbles
        return float(sum(bubbles) / len(bubbles)) if bubbles else 0.0


def _action_costs(kind: str, forward: np.ndarray, backward: np.ndarray, weight: np.ndarray):
    if kind == "F":
        return forward
    if kind == "B":
        return backward
    if kind == "I":
        return backward - weight
    return weight


def simulate(shape: PipelineShape, forward: np.ndarray, backward: np.ndarray, weight: Optional[np.ndarray] = None,
             p2p_cost: float = 0.0, order: Optional[Sequence[int]] = None, keep_events: bool = False) -> PipelineTimeline:
    """Play the schedule of ``shape`` on costs ``forward[s][j]`` and ``backward[s][j]`` (stage s,
    micro-batch j; a whole backward) and, for the zero-bubble schedule, ``weight[s][j]`` (the part
    of the backward that computes weight gradients; default half of it). ``order``: the micro-batch
    the schedule's j-th slot runs (default the identity). ``p2p_cost`` is added to every dependency
    that crosses ranks."""
    forward = np.asarray(forward, dtype=np.float64)
    backward = np.asarray(backward, dtype=np.float64)
    if forward.ndim != 2 or forward.shape != backward.shape or forward.shape[0] != shape.num_stages:
        raise ValueError(f"costs must be (num_stages={shape.num_stages}, micro-batches) arrays, got "
                         f"{forward.shape} and {backward.shape}")
    weight = 0.5 * backward if weight is None else np.asarray(weight, dtype=np.float64)
    if order is not None:
        idx = np.asarray(order, dtype=np.int64)
        forward, backward, weight = forward[:, idx], backward[:, idx], weight[:, idx]
    m = forward.shape[1]
    costs = {kind: _action_costs(kind, forward, backward, weight).tolist() for kind in "FBIW"}
    orders = rank_orders(shape, m)
    last = shape.num_stages - 1
    done: dict[tuple[str, int, int], float] = {}
    pointer = [0] * shape.pp_size
    free = [0.0] * shape.pp_size
    busy = [0.0] * shape.pp_size
    events = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank, acts in enumerate(orders):
            while pointer[rank] < len(acts):
                act = acts[pointer[rank]]
                ready = _ready_time(act, done, last, shape, p2p_cost)
                if ready is None:
                    break
                start = max(free[rank], ready)
                cost = costs[act.kind][act.stage][act.micro]
                free[rank] = start + cost
                busy[rank] += cost
                done[(act.kind, act.stage, act.micro)] = start + cost
                if keep_events:
                    events.append((rank, act, start, start + cost))
                pointer[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {shape.schedule} action orders deadlock at {pointer}")
    return PipelineTimeline(step_time=max(free), busy=tuple(busy), events=tuple(events))


def _ready_time(act: Action, done: dict, last: int, shape: PipelineShape, p2p_cost: float) -> Optional[float]:
    """When ``act``'s inputs exist, or None while one is missing."""
    kind, stage, j = act
    if kind == "F":
        dep = None if stage == 0 else ("F", stage - 1, j)
    elif kind in ("B", "I"):
        if stage == last:
            dep = ("F", stage, j)
        else:
            nxt = ("B", stage + 1, j)
            dep = nxt if nxt in done else ("I", stage + 1, j)
    else:
        dep = ("I", stage, j)
    if dep is None:
        return 0.0
    end = done.get(dep)
    if end is None:
        return None
    crosses = shape.rank_of(dep[1]) != shape.rank_of(stage)
    return end + (p2p_cost if crosses else 0.0)


def bubble_formula(shape: PipelineShape, num_micro_batches: int) -> Optional[float]:
    """The textbook bubble fraction with equal micro-batches and stages: ``(p - 1) / (v m + p - 1)``
    for 1F1B (v = 1) and interleaved 1F1B; None for zero bubble, whose bubble depends on how the
    weight gradients fill it."""
    if shape.schedule is PipelineScheduleKind.ZERO_BUBBLE:
        return None
    p, v, m = shape.pp_size, shape.virtual_stages, num_micro_batches
    return (p - 1) / (v * m + p - 1)


def split_layers(layer_costs: Sequence[float], num_stages: int, first_extra: float = 0.0,
                 last_extra: float = 0.0) -> tuple[tuple[int, int], ...]:
    """Contiguous ``[start, end)`` layer ranges of ``num_stages`` stages, each at least one layer,
    minimising the costliest stage; the first stage also pays ``first_extra`` (embeddings), the last
    ``last_extra`` (final norm and output head). Exact (dynamic programming over cut points); ties
    go to the split whose earlier stages hold fewer layers."""
    costs = np.asarray(layer_costs, dtype=np.float64)
    n = len(costs)
    if num_stages < 1 or n < num_stages:
        raise ValueError(f"{n} decoder layers cannot be split into {num_stages} pipeline stages of at least one "
                         "layer each (pipeline_model_parallel_size x virtual_pipeline_model_parallel_size stages)")
    prefix = np.concatenate([[0.0], np.cumsum(costs)])

    def stage_cost(s: int, a: int, b: int) -> float:
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == num_stages - 1 else 0.0)
        return float(prefix[b] - prefix[a]) + extra

    inf = float("inf")
    # best[s][b]: the lowest bottleneck of stages 0..s covering layers [0, b); cut[s][b]: where stage s starts
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for b in range(1, n + 1):
        best[0][b] = stage_cost(0, 0, b)
    for s in range(1, num_stages):
        for b in range(s + 1, n + 1):
            for a in range(s, b):
                value = max(best[s - 1][a], stage_cost(s, a, b))
                if value < best[s][b] - 1e-12 * max(1.0, value):
                    best[s][b], cut[s][b] = value, a
    bounds, b = [], n
    for s in range(num_stages - 1, 0, -1):
        a = cut[s][b]
        bounds.append((a, b))
        b = a
    bounds.append((0, b))
    return tuple(reversed(bounds))
