"""The pipeline schedules as data (`ballast.balance.pipeline`): the action orders are torch's, the
simulator respects every dependency, equal costs give the textbook bubble, and the stage split is
optimal."""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest

from ballast.balance.pipeline import (
    PipelineScheduleKind, PipelineShape, bubble_formula, rank_orders, simulate, split_layers,
)

SHAPES = [PipelineShape(p, v, kind) for p, v, kind in [
    (2, 1, "1f1b"), (4, 1, "1f1b"), (3, 1, "1f1b"),
    (2, 1, "interleaved_1f1b"), (2, 2, "interleaved_1f1b"), (4, 2, "interleaved_1f1b"), (2, 3, "interleaved_1f1b"),
    (2, 1, "zero_bubble"), (2, 2, "zero_bubble"), (4, 1, "zero_bubble"), (4, 2, "zero_bubble"),
]]


def _counts(shape, upto=13):
    return [m for m in range(1, upto) if shape.count_error(m) is None]


def _torch_order(shape: PipelineShape, m: int) -> dict[int, list[str]]:
    """torch 2.13's own per-rank compute order (its schedule objects over stand-in stages)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble
    from torch.distributed.pipelining.schedules import _ComputationType as C

    p, v = shape.pp_size, shape.virtual_stages

    def stages(rank):
        return [types.SimpleNamespace(group_size=p, group_rank=rank, num_stages=p * v, stage_index=rank + k * p,
                                      is_first=rank + k * p == 0, is_last=rank + k * p == p * v - 1, submod=None)
                for k in range(v)]

    if shape.schedule is PipelineScheduleKind.ONE_F_ONE_B:
        # Schedule1F1B's own IR (`_get_pipeline_order`, for visualisation) is off by one on the last
        # stage; what counts is what `_step_microbatches` executes, recorded here on a stand-in stage.
        return {s: _executed_1f1b(Schedule1F1B, p, s, m) for s in range(p)}
    else:
        cls = ScheduleInterleaved1F1B if shape.schedule is PipelineScheduleKind.INTERLEAVED_1F1B \
            else ScheduleInterleavedZeroBubble
        order = cls(stages(0), m, loss_fn=None).pipeline_order
    compute = {C.FORWARD, C.FULL_BACKWARD, C.BACKWARD_INPUT, C.BACKWARD_WEIGHT}
    out = {}
    for rank, acts in order.items():
        out[rank] = [str(a) for a in acts if a is not None and a.computation_type in compute]
    return out


class _RecordingStage:
    """Enough of a pipeline stage for Schedule1F1B to run in one process: no communication, every
    forward and backward recorded."""

    def __init__(self, stage, num_stages):
        self.stage_index, self.num_stages, self.device = stage, num_stages, "cpu"
        self.is_first, self.is_last, self.has_backward = stage == 0, stage == num_stages - 1, True
        self.calls = []

    def forward_one_chunk(self, j, *args, **kwargs):
        self.calls.append(f"{self.stage_index}F{j}")

    def backward_one_chunk(self, j, *args, **kwargs):
        self.calls.append(f"{self.stage_index}B{j}")

    def _no_ops(self, *args, **kwargs):
        return []

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = _get_init_p2p_neighbors_ops = _no_ops

    def _prepare_forward_infra(self, *args, **kwargs):
        return None

    _prepare_backward_infra = perform_reduce_grad = clear_runtime_states = _prepare_forward_infra


def _executed_1f1b(cls, p, s, m):
    stage = _RecordingStage(s, p)
    schedule = cls(stage, m, loss_fn=None)
    schedule._has_backward = True  # loss_fn=None would make it forward-only
    schedule._step_microbatches()
    return stage.calls


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.schedule}-p{s.pp_size}-v{s.virtual_stages}")
def test_action_orders_are_torchs(shape):
    for m in _counts(shape):
        ours = {rank: [str(a) for a in acts] for rank, acts in enumerate(rank_orders(shape, m))}
        assert ours == _torch_order(shape, m), (shape, m)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.schedule}-p{s.pp_size}-v{s.virtual_stages}")
def test_equal_costs_give_the_textbook_bubble(shape):
    for m in _counts(shape, 17):
        timeline = simulate(shape, np.ones((shape.num_stages, m)), 2 * np.ones((shape.num_stages, m)))
        expected = bubble_formula(shape, m)
        if expected is None:  # zero bubble: the weight gradients fill part of the 1F1B bubble
            one_f_one_b = (shape.pp_size - 1) / (shape.virtual_stages * m + shape.pp_size - 1)
            assert 0 <= timeline.bubble_fraction < one_f_one_b
        elif shape.schedule is PipelineScheduleKind.ONE_F_ONE_B or m % shape.pp_size == 0:
            assert timeline.bubble_fraction == pytest.approx(expected, abs=1e-12), (shape, m)


def test_simulated_timelines_respect_dependencies_and_ranks():
    rng = np.random.default_rng(3)
    for shape in SHAPES:
        m = _counts(shape)[-1]
        forward = rng.uniform(0.5, 2.0, (shape.num_stages, m))
        backward = 2 * forward * rng.uniform(0.8, 1.2, forward.shape)
        timeline = simulate(shape, forward, backward, p2p_cost=0.1, keep_events=True)
        end = {(a.kind, a.stage, a.micro): e for _, a, _, e in timeline.events}
        per_rank = {}
        for rank, act, start, stop in timeline.events:
            assert rank == act.stage % shape.pp_size
            per_rank.setdefault(rank, []).append((start, stop))
            hop = 0.1
            if act.kind == "F" and act.stage > 0:
                assert start >= end[("F", act.stage - 1, act.micro)] + (hop if shape.pp_size > 1 else 0) - 1e-9
            if act.kind in "BI" and act.stage < shape.num_stages - 1:
                prev = end.get(("B", act.stage + 1, act.micro), end.get(("I", act.stage + 1, act.micro)))
                assert start >= prev + hop - 1e-9
            if act.kind in "BI" and act.stage == shape.num_stages - 1:
                assert start >= end[("F", act.stage, act.micro)] - 1e-9
        for spans in per_rank.values():
            spans.sort()
            assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))  # one action at a time
        expected_busy = [forward[s::shape.pp_size].sum() + backward[s::shape.pp_size].sum() for s in range(shape.pp_size)]
        assert np.allclose(timeline.busy, expected_busy)
        assert timeline.step_time == pytest.approx(max(e for *_, e in timeline.events))


def test_a_reordering_moves_the_costs_with_the_micro_batches():
    shape = PipelineShape(2)
    forward = np.array([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    order = [2, 0, 1]
    a = simulate(shape, forward, 2 * forward, order=order)
    b = simulate(shape, forward[:, order], 2 * forward[:, order])
    assert a.step_time == b.step_time and a.busy == b.busy


def test_shape_rules_name_the_setting():
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule"):
        PipelineShape(2, 2, "1f1b")
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage=3"):
        PipelineShape(2, 2, "interleaved_1f1b", microbatch_group_size=3)
    with pytest.raises(ValueError, match="pp_size >= 2"):
        PipelineShape(1)
    with pytest.raises(ValueError, match="schedule must be one of"):
        PipelineShape(2, 1, "gpipe")
    assert PipelineShape(2, 1, "1f1b", microbatch_group_size=5).count_multiple == 1  # verl's rule: VPP only
    vpp = PipelineShape(4, 2, "interleaved_1f1b")
    assert vpp.count_error(3) and "fewer than" in vpp.count_error(3)
    assert "multiple of microbatch_group_size_per_vp_stage=4" in vpp.count_error(6)
    assert [vpp.valid_count(m) for m in (1, 4, 5, 9)] == [4, 4, 8, 12]
    flexible = PipelineShape(4, 1, "zero_bubble")  # torch's rounds: m % (m // p) == 0
    assert flexible.count_error(9) and flexible.valid_count(9) == 10
    for shape in SHAPES:
        for m in range(1, 30):
            assert shape.count_error(shape.valid_count(m)) is None and shape.valid_count(m) >= m
    with pytest.raises(ValueError, match="fewer than the pipeline's 4 ranks"):
        rank_orders(PipelineShape(4), 3)


def _brute_force_split(costs, stages, first, last):
    best = None
    n = len(costs)
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = list(zip((0,) + cuts, cuts + (n,)))
        top = max(sum(costs[a:b]) + (first if s == 0 else 0) + (last if s == stages - 1 else 0)
                  for s, (a, b) in enumerate(bounds))
        best = top if best is None else min(best, top)
    return best


def test_stage_split_is_optimal_and_gives_every_stage_a_layer():
    rng = np.random.default_rng(5)
    for _ in range(40):
        n, stages = int(rng.integers(2, 9)), int(rng.integers(1, 5))
        if stages > n:
            continue
        costs = rng.uniform(0.5, 2.0, n).tolist()
        first, last = float(rng.uniform(0, 2)), float(rng.uniform(0, 4))
        bounds = split_layers(costs, stages, first, last)
        assert bounds[0][0] == 0 and bounds[-1][1] == n and all(b > a for a, b in bounds)
        assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
        top = max(sum(costs[a:b]) + (first if s == 0 else 0) + (last if s == stages - 1 else 0)
                  for s, (a, b) in enumerate(bounds))
        assert top == pytest.approx(_brute_force_split(costs, stages, first, last))
    # SmolLM2's head costs about four layers at half the tokens: the last of two stages gets fewer
    assert split_layers([1.0] * 30, 2, last_extra=4.0) == ((0, 17), (17, 30))
    with pytest.raises(ValueError, match="2 decoder layers cannot be split into 4 pipeline stages"):
        split_layers([1.0, 1.0], 4)
