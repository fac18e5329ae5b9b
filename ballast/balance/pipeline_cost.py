"""The pipeline cost model: what one micro-batch costs on each stage, and the order to run them in.

Every micro-batch of a pipeline phase travels between stages in a fixed slot of ``slot_tokens``
tokens (its packed sequences, then padding), so the stages' receive buffers never change shape; a
stage computes on the real tokens only and pads its output back to the slot. On a stage holding
``n`` decoder layers a micro-batch's forward therefore costs

    n * (layer_flops_per_token * real_tokens + layer_flops_per_pair * pairs + overhead)  (+ the head on the last)

where ``pairs = sum L (L + 1) / 2`` over its packed sequences (causal attention runs per sequence),
``overhead`` is a fixed cost of one pass of a micro-batch through a layer (kernel launches, the
per-sequence attention calls; in the same units), and the output head runs only on the positions
that predict a response token (``head_tokens``). The backward costs ``backward_ratio`` times the
forward's compute; its weight-gradient part (what the zero-bubble schedule defers) is the linear
layers' share of one forward. Every hop between ranks costs ``p2p_cost`` (one slot of activations,
padding included: the only place padding costs). Costs are FLOPs (:meth:`PipelineCostModel.from_flops`)
or, from measured per-layer seconds, seconds (:meth:`PipelineCostModel.from_layer_seconds`), which
is how docs/pipeline.md predicts a user's cluster.

Ordering (:func:`order_micro_batches`): verl places the smaller micro-batches at both ends
(:func:`pyramid_order`) to shrink the warm-up and cool-down bubbles; here the order is searched with
the schedule simulator (:func:`ballast.balance.pipeline.simulate`) itself, starting from the pyramid,
so the predicted step is never longer than the pyramid's.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from .pipeline import PipelineShape, PipelineTimeline, simulate, split_layers
from .workload import FlopsModel, _as_lengths

# Simulations one ordering search may run per rank: a few milliseconds each for tens of micro-batches.
_ORDER_SEARCH_EVALS = 96
# A layer pass of a micro-batch costs at least as much as this many tokens' linear work (launches,
# per-sequence attention calls): what keeps the planner from cutting into ever more micro-batches.
DEFAULT_OVERHEAD_TOKENS = 32.0


@dataclasses.dataclass(frozen=True)
class MicroBatchWork:
    """What one micro-batch asks of the pipeline: its sequences' real tokens, causal attention pairs
    and the positions where the output head runs (None when unknown: a fraction of the real tokens)."""

    real_tokens: int
    attention_pairs: float
    head_tokens: Optional[int] = None

    @classmethod
    def of(cls, lengths: Sequence[int] | np.ndarray, response_lengths: Sequence[int] | np.ndarray | None = None):
        tokens = _as_lengths(lengths).astype(np.float64)
        head = None if response_lengths is None else int(_as_lengths(response_lengths).sum())
        return cls(real_tokens=int(tokens.sum()), attention_pairs=float((tokens * (tokens + 1.0) / 2.0).sum()),
                   head_tokens=head)


@dataclasses.dataclass(frozen=True)
class PipelineCostModel:
    """Per-stage costs of fixed-slot micro-batches through a pipeline of ``shape``; see the module
    docstring. ``stage_layers[s]``: decoder layers of stage s. ``head_token_fraction``: the share of
    a micro-batch's real tokens the head runs on when a micro-batch does not say (a GRPO step's
    responses are roughly half its tokens). ``p2p_cost``: one activation transfer between ranks."""

    shape: PipelineShape
    stage_layers: tuple[int, ...]
    layer_flops_per_token: float
    layer_flops_per_pair: float
    head_flops_per_token: float
    layer_overhead: float = 0.0
    backward_ratio: float = 2.0
    head_token_fraction: float = 0.5
    p2p_cost: float = 0.0

    def __post_init__(self) -> None:
        if len(self.stage_layers) != self.shape.num_stages or min(self.stage_layers) < 1:
            raise ValueError(f"stage_layers must give each of the {self.shape.num_stages} stages >= 1 layer, "
                             f"got {self.stage_layers}")
        if self.backward_ratio < 1.0:
            raise ValueError(f"backward_ratio must be >= 1 (a backward recomputes no less than the forward), "
                             f"got {self.backward_ratio}")

    @classmethod
    def from_flops(cls, flops: FlopsModel, shape: PipelineShape, stage_layers: Optional[Sequence[int]] = None, overhead_tokens: float = DEFAULT_OVERHEAD_TOKENS,
                   **kwargs) -> "PipelineCostModel":
        """FLOPs of ``flops`` (a model's config), split into stages by :func:`balanced_stage_layers`
        unless ``stage_layers`` is given; a layer pass's overhead counts as ``overhead_tokens``
        tokens of its linear work."""
        head = 2.0 * flops.hidden_size * flops.vocab_size
        per_token = (flops.linear_flops_per_token - head) / flops.num_layers
        per_pair = flops.attention_flops_per_pair / flops.num_layers
        kwargs.setdefault("layer_overhead", overhead_tokens * per_token)
        if stage_layers is None:
            fraction = kwargs.get("head_token_fraction", cls.head_token_fraction)
            stage_layers = balanced_stage_layers(flops.num_layers, shape.num_stages, per_token, head * fraction)
        return cls(shape=shape, stage_layers=tuple(int(n) for n in stage_layers), layer_flops_per_token=per_token,
                   layer_flops_per_pair=per_pair, head_flops_per_token=head, **kwargs)

    @classmethod
    def from_layer_seconds(cls, shape: PipelineShape, num_layers: int, tokens_measured: int,
                           layer_seconds: float, head_seconds: float, **kwargs) -> "PipelineCostModel":
        """Costs in seconds from measurements on one device: ``layer_seconds`` is one decoder layer's
        forward over a micro-batch of ``tokens_measured`` packed tokens of typical sequence lengths
        (attention included), ``head_seconds`` the output head's forward over as many positions;
        ``layer_overhead`` and ``p2p_cost`` (seconds) may be given. Attention is folded into the
        per-token cost (exact at the measured lengths)."""
        if tokens_measured < 1 or layer_seconds <= 0 or head_seconds < 0:
            raise ValueError(f"need tokens_measured >= 1, layer_seconds > 0 and head_seconds >= 0, got "
                             f"{tokens_measured}, {layer_seconds}, {head_seconds}")
        per_token, head = layer_seconds / tokens_measured, head_seconds / tokens_measured
        stage_layers = kwargs.pop("stage_layers", None)
        if stage_layers is None:
            fraction = kwargs.get("head_token_fraction", cls.head_token_fraction)
            stage_layers = balanced_stage_layers(num_layers, shape.num_stages, per_token, head * fraction)
        return cls(shape=shape, stage_layers=tuple(int(n) for n in stage_layers), layer_flops_per_token=per_token,
                   layer_flops_per_pair=0.0, head_flops_per_token=head, **kwargs)

    def stage_costs(self, works: Sequence[MicroBatchWork]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(forward, backward, weight-gradient part of the backward), each (num_stages, len(works));
        an empty micro-batch (no real tokens) still pays the per-layer overhead."""
        layers = np.asarray(self.stage_layers, dtype=np.float64)[:, None]
        real = np.array([w.real_tokens for w in works], dtype=np.float64)[None, :]
        pairs = np.array([w.attention_pairs for w in works], dtype=np.float64)[None, :]
        head_tokens = np.array([w.head_tokens if w.head_tokens is not None else self.head_token_fraction * w.real_tokens
                                for w in works], dtype=np.float64)
        linear = layers * self.layer_flops_per_token * real
        compute = linear + layers * self.layer_flops_per_pair * pairs
        compute[-1] += self.head_flops_per_token * head_tokens
        linear[-1] += self.head_flops_per_token * head_tokens
        overhead = layers * self.layer_overhead
        forward = compute + overhead
        backward = self.backward_ratio * compute + overhead
        return forward, backward, np.minimum(linear, backward)

    def simulate(self, works: Sequence[MicroBatchWork], order: Optional[Sequence[int]] = None,
                 keep_events: bool = False) -> PipelineTimeline:
        forward, backward, weight = self.stage_costs(works)
        return simulate(self.shape, forward, backward, weight, self.p2p_cost, order=order, keep_events=keep_events)


def balanced_stage_layers(num_layers: int, num_stages: int, layer_cost: float, head_cost: float) -> tuple[int, ...]:
    """Layers per stage balancing equal layers against the output head on the last stage (the
    embedding lookup costs next to nothing and stays with the first)."""
    bounds = split_layers([layer_cost] * num_layers, num_stages, first_extra=0.0, last_extra=head_cost)
    return tuple(b - a for a, b in bounds)


def pyramid_order(costs: Sequence[float]) -> np.ndarray:
    """verl's order (``rearrange_micro_batches`` with dynamic balance): by decreasing cost (ties: lower
    index first), then every other one reversed in front of the rest, so the smallest sit at both
    ends and the largest in the middle."""
    costs = np.asarray(costs, dtype=np.float64)
    by_cost = sorted(range(len(costs)), key=lambda j: (-costs[j], j))
    return np.asarray(by_cost[::2][::-1] + by_cost[1::2], dtype=np.int64)


def order_micro_batches(model: PipelineCostModel, works: Sequence[MicroBatchWork],
                        max_evals: int = _ORDER_SEARCH_EVALS) -> tuple[np.ndarray, PipelineTimeline]:
    """The micro-batch order (indices into ``works``) with the shortest simulated step found, and its
    timeline. Starts from the best of the pyramid, decreasing and increasing cost; then moves single
    micro-batches to the ends and swaps neighbours while that shortens the step, within ``max_evals``
    simulations. Never worse than the pyramid in the model."""
    m = len(works)
    totals = model.stage_costs(works)[0].sum(axis=0)
    starts = [pyramid_order(totals), np.argsort(-totals, kind="stable"), np.argsort(totals, kind="stable")]
    best_order, best = None, None
    for order in starts:
        timeline = model.simulate(works, order)
        if best is None or timeline.step_time < best.step_time:
            best_order, best = np.asarray(order, dtype=np.int64), timeline
    evals = len(starts)
    improved = True
    while improved and evals < max_evals:
        improved = False
        for candidate in _neighbours(best_order, m):
            if evals >= max_evals:
                break
            timeline = model.simulate(works, candidate)
            evals += 1
            if timeline.step_time < best.step_time * (1.0 - 1e-12):
                best_order, best, improved = candidate, timeline, True
                break
    return best_order, best


def _neighbours(order: np.ndarray, m: int):
    """Orders one move away: a micro-batch taken to the front or the back, then neighbour swaps."""
    for j in range(1, m):
        yield np.concatenate([[order[j]], np.delete(order, j)])
    for j in range(m - 1):
        yield np.concatenate([np.delete(order, j), [order[j]]])
    for j in range(m - 1):
        swapped = order.copy()
        swapped[j], swapped[j + 1] = swapped[j + 1], swapped[j]
        yield swapped
