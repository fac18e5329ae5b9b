"""Rows that share one prompt, run as one unit: the prompt once, then every row's response.

A GRPO step samples ``n`` responses for every prompt, so a micro-batch that holds a whole group
repeats the same prompt tokens ``n`` times. Run shared, the prompt's tokens go through the model
once and every response attends to them (``ballast.engine.shared_prefix``): the log-probs and the
gradient are those of the rows run apart, at ``P + sum(R_i)`` tokens instead of ``n * P + sum(R_i)``.

For that a group must never be split: :func:`prompt_units` turns per-row prompt ids into units (a
group's rows, adjacent), :func:`shared_lengths` gives each unit's executed tokens, and the planner
(:func:`ballast.balance.plan_phase` with ``shared_prompts=``) plans units, then expands them to rows.
:func:`micro_batch_tokens` counts what a micro-batch of rows executes, for the engine's budget check.
Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class PromptUnits:
    """``members[u]``: the rows of unit ``u`` in row order; units in order of their first row."""

    members: tuple[np.ndarray, ...]

    @property
    def size(self) -> int:
        """Rows per unit (every unit has as many: equal row counts per rank need it)."""
        return int(len(self.members[0])) if self.members else 0

    def rows(self, units: Sequence[int] | np.ndarray) -> np.ndarray:
        """The rows of ``units``, unit by unit."""
        units = np.asarray(units, dtype=np.int64).reshape(-1)
        if not len(units):
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.members[u] for u in units])

    def positions(self, unit_positions: np.ndarray) -> np.ndarray:
        """Row positions of the units at ``unit_positions`` inside a slice made of whole units."""
        unit_positions = np.asarray(unit_positions, dtype=np.int64).reshape(-1)
        size = self.size
        return (unit_positions[:, None] * size + np.arange(size)[None, :]).reshape(-1)


def prompt_units(prompt_ids: Sequence[Any] | np.ndarray) -> PromptUnits:
    """Units of the rows sharing each prompt id; every unit must have the same number of rows."""
    ids = np.asarray(prompt_ids).reshape(-1)
    if not len(ids):
        return PromptUnits(())
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    members = tuple(np.flatnonzero(inverse == g) for g in np.argsort(first, kind="stable"))
    sizes = sorted({len(m) for m in members})
    if len(sizes) > 1:
        raise ValueError(f"shared prompts need the same number of rows for every prompt, got group sizes {sizes} "
                         "(a filter that drops single samples breaks whole groups; drop whole groups instead)")
    return PromptUnits(members)


def shared_lengths(lengths: np.ndarray, prompt_lengths: np.ndarray, units: PromptUnits) -> np.ndarray:
    """Tokens each unit executes: its prompt once plus every member's response."""
    lengths, prompt_lengths = np.asarray(lengths, dtype=np.int64), np.asarray(prompt_lengths, dtype=np.int64)
    out = np.zeros(len(units.members), dtype=np.int64)
    for u, rows in enumerate(units.members):
        prompt = prompt_lengths[rows]
        if (prompt != prompt[0]).any():
            raise ValueError(f"rows {rows.tolist()} share a prompt id but have prompt lengths {prompt.tolist()}")
        out[u] = int(prompt[0]) + int((lengths[rows] - prompt).sum())
    return out


def micro_batch_tokens(lengths: np.ndarray, prompt_lengths: np.ndarray, prompt_ids: np.ndarray,
                       rows: np.ndarray) -> int:
    """Tokens a shared micro-batch of ``rows`` executes: each distinct prompt once, every response."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return 0
    responses = int((np.asarray(lengths)[rows] - np.asarray(prompt_lengths)[rows]).sum())
    _, first = np.unique(np.asarray(prompt_ids)[rows], return_index=True)
    return responses + int(np.asarray(prompt_lengths)[rows][first].sum())
