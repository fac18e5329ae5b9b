"""torch.distributed.pipelining behind one call: this rank's stages through the configured schedule.

Stages are built in torch's static mode: every stage is told its input and output shapes (from the
slot size), so no schedule ever runs a serialized forward/backward to infer them. One schedule (and
its stages, whose receive buffers have the slot's shape) is kept per (slot tokens, micro-batch
count, training or forward-only): a step of the same shape reuses it, a new shape builds another
(cheap in static mode). Micro-batches are handed over already cut, through torch 2.13's
``_step_microbatches`` (``step()`` would split one tensor itself), after the same per-step reset that
``step()`` does (``has_backward``, ``clear_runtime_states``).

The schedule does not scale anything (``scale_grads=False``): each micro-batch's loss is already its
exact share of the mini-batch loss (normalised by the global token count, `ballast.engine.losses`),
so the summed gradients are the mini-batch's, as in the non-pipeline engine.

Every stage's forward and backward pieces (F, B, or I and W under zero bubble) and the last stage's
loss are timed; a rank's bubble is the part of the step it spent in none of them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)

from ballast.balance.pipeline import PipelineScheduleKind, PipelineShape
from ballast.engine.pipeline.layout import PipelineParallelState
from ballast.engine.pipeline.slots import PackedMicroBatch, check_slots
from ballast.engine.pipeline.stages import StageModule

_SCHEDULES = {
    PipelineScheduleKind.ONE_F_ONE_B: Schedule1F1B,
    PipelineScheduleKind.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
    PipelineScheduleKind.ZERO_BUBBLE: ScheduleInterleavedZeroBubble,
}
# Schedules (with their stages' buffers) kept for reuse: a phase with a budget of its own, and its
# forward-only and training variants, each keep one.
_CACHED_SCHEDULES = 6


@dataclass
class StepTimeline:
    """One schedule run on this rank: wall seconds, seconds spent computing, and the pieces."""

    wall_s: float = 0.0
    busy_s: float = 0.0
    events: list = field(default_factory=list)  # (kind, stage, micro-batch, start, end), perf_counter seconds

    def record(self, kind: str, stage: int, micro: int, start: float) -> None:
        end = time.perf_counter()
        self.events.append((kind, stage, micro, start, end))
        self.busy_s += end - start


class _TimedStage(PipelineStage):
    """A pipeline stage that records when its forwards and backwards run."""

    timeline: StepTimeline

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        start = time.perf_counter()
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self.timeline.record("F", self.stage_index, fwd_chunk_id, start)
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        start = time.perf_counter()
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        self.timeline.record("B" if full_backward else "I", self.stage_index, bwd_chunk_id, start)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        start = time.perf_counter()
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self.timeline.record("W", self.stage_index, bwd_chunk_id, start)


LossFn = Callable[[torch.Tensor, int], torch.Tensor]


class PipelineRunner:
    """Runs this rank's ``modules`` (stages ``stage_indices``) through the schedule of ``shape``."""

    def __init__(self, modules: list[StageModule], stage_indices: list[int], shape: PipelineShape,
                 parallel: PipelineParallelState, hidden_size: int, dtype: torch.dtype) -> None:
        self.modules, self.stage_indices, self.shape = modules, stage_indices, shape
        self.parallel, self.hidden_size, self.dtype = parallel, hidden_size, dtype
        self._cache: OrderedDict[tuple, tuple] = OrderedDict()
        self._loss: Optional[LossFn] = None
        self._timeline = StepTimeline()

    def _meta(self, stage: int, slot_tokens: int, output: bool, out_rows: int) -> torch.Tensor:
        last = stage == self.shape.num_stages - 1
        if output and last:
            return torch.empty(out_rows, slot_tokens, dtype=torch.float32, device="meta", requires_grad=True)
        if not output and stage == 0:
            return torch.empty(1, slot_tokens, dtype=torch.int64, device="meta")
        return torch.empty(1, slot_tokens, self.hidden_size, dtype=self.dtype, device="meta", requires_grad=True)

    def _schedule(self, slot_tokens: int, count: int, backward: bool, out_rows: int):
        key = (slot_tokens, count, backward, out_rows)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        stages = []
        for index, module in zip(self.stage_indices, self.modules):
            stage = _TimedStage(module, index, self.shape.num_stages, self.parallel.device,
                                input_args=self._meta(index, slot_tokens, False, out_rows),
                                output_args=self._meta(index, slot_tokens, True, out_rows),
                                group=self.parallel.pp_group)
            stages.append(stage)
        cls = _SCHEDULES[self.shape.schedule]
        target = stages[0] if cls is Schedule1F1B else stages
        schedule = cls(target, count, loss_fn=self._call_loss if backward else None, scale_grads=False)
        self._cache[key] = (schedule, stages)
        if len(self._cache) > _CACHED_SCHEDULES:
            self._cache.popitem(last=False)
        return schedule, stages

    def _call_loss(self, output: torch.Tensor, micro: int) -> torch.Tensor:
        start = time.perf_counter()
        loss = self._loss(output, micro)
        self._timeline.record("L", self.shape.num_stages - 1, micro, start)
        return loss

    def run(self, micro_batches: list[PackedMicroBatch], slot_tokens: int, out_rows: int,
            loss: Optional[LossFn]) -> tuple[list[torch.Tensor], StepTimeline]:
        """One schedule step over ``micro_batches`` (all of this mini-batch's, in execution order):
        with ``loss`` (called on the last stage with its (rows, T) output and the micro-batch index)
        forward and backward, gradients accumulated into ``.grad``; without, forward only, and the
        last stage's outputs are returned (empty list elsewhere). A micro-batch whose tensors are not
        the slot's shape is a ValueError before anything runs. Collective over the pipeline."""
        check_slots(micro_batches, slot_tokens)  # before any send or receive, on every rank alike
        backward = loss is not None
        schedule, stages = self._schedule(slot_tokens, len(micro_batches), backward, out_rows)
        self._loss, self._timeline = loss, StepTimeline()
        for stage in stages:
            stage.timeline = self._timeline
            stage.has_backward = backward
            stage.clear_runtime_states()
        args = [(mb.input_ids,) for mb in micro_batches]
        kwargs = [{"slot": mb.slot} for mb in micro_batches]
        targets = list(range(len(micro_batches))) if backward else None
        start = time.perf_counter()
        try:
            schedule._step_microbatches(args, kwargs, targets, None, return_outputs=not backward)
        finally:
            self._timeline.wall_s = time.perf_counter() - start
            self._loss = None
        outputs = []
        for stage in stages:
            if stage.is_last and not backward:
                outputs = [out.detach() for out in stage.output_chunks]
            stage.clear_runtime_states()
        return outputs, self._timeline
