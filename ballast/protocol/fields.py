"""The canonical Batch keys: shape, dtype and meaning of every field the trainer passes around.

Symbolic dimensions: B = samples in the batch, P = prompt length (left-padded), R = response
length (right-padded), "P+R" = full sequence. `FIELDS` is the table; `check_fields` checks that a
Batch carries the named fields with the right kind, dtype and mutually consistent shapes, and is
meant to be called where a Batch enters a worker or an algorithm, so that a misnamed or misshaped
field fails there with its name rather than as a broadcast error deep in a loss function.

| key | shape | dtype | meaning |
|---|---|---|---|
| prompts | (B, P) | int64 | prompt token ids, left-padded with the pad token |
| responses | (B, R) | int64 | generated token ids, right-padded with the pad token |
| input_ids | (B, P+R) | int64 | prompts followed by responses |
| attention_mask | (B, P+R) | int64 | 1 on real prompt and response tokens, 0 on padding |
| position_ids | (B, P+R) | int64 | 0-based position of each real token |
| response_mask | (B, R) | int64 | 1 on response tokens that count in losses (through EOS), 0 after |
| old_log_probs | (B, R) | float32 | log-prob of each response token under the actor before the update |
| old_log_probs_from_update | (B,) | bool | the row's old log-probs come from the update's own forward (first mini-batch) |
| ref_log_prob | (B, R) | float32 | log-prob of each response token under the reference policy |
| rollout_log_probs | (B, R) | float32 | log-prob reported by the rollout engine that sampled the token |
| values | (B, R) | float32 | critic value estimate at each response token |
| advantages | (B, R) | float32 | advantage of each response token (GRPO, GAE, RLOO, ...) |
| returns | (B, R) | float32 | value-function target at each response token |
| token_level_scores | (B, R) | float32 | reward-function score placed on response tokens (usually the last) |
| token_level_rewards | (B, R) | float32 | scores after the in-reward KL penalty (equal to scores without it) |
| uid | (B,) | object | prompt id shared by the n samples of one prompt (GRPO groups) |
| data_source | (B,) | object | name of the data set a sample came from; selects the reward function |
| reward_model | (B,) | object | per-sample dict with at least "ground_truth" for the rule reward |
| extra_info | (B,) | object | the dataset row's dict; the score function gets it with the rollout's keys |
| agent_num_turns | (B,) | int64 | agent-loop rollouts (numpy): turns of the conversation, verl's count |
| agent_tool_rewards | (B,) | object | agent-loop rollouts: list of each answered tool call's reward |
| agent_turn_scores | (B,) | object | agent-loop rollouts: list of per-turn scores the loop recorded |

Non-tensor fields are numpy arrays (an int64 one too). The agent-loop columns are written by the
request-level rollout (`ballast.workers.agent_loop.output`); the reward reads the last three.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ballast.protocol._checks import dtype_name

if TYPE_CHECKING:  # only for the annotation; check_fields needs nothing but `in`, `[]` and `len`
    from ballast.protocol.batch import Batch

SAMPLE_DIM = "B"


@dataclass(frozen=True)
class FieldSpec:
    """One canonical field: symbolic shape, dtype (torch dtype: a tensor; numpy dtype: a non-tensor)."""

    name: str
    shape: tuple[str, ...]
    dtype: torch.dtype | np.dtype
    meaning: str

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.dtype, torch.dtype)

    def describe(self) -> str:
        kind = "tensor" if self.is_tensor else "non-tensor"
        return f"({', '.join(self.shape)}) {dtype_name(self.dtype)} {kind}: {self.meaning}"


_I64, _F32, _OBJ = torch.int64, torch.float32, np.dtype(object)
_SEQ, _RESP = ("B", "P+R"), ("B", "R")

FIELDS: dict[str, FieldSpec] = {
    spec.name: spec
    for spec in [
        FieldSpec("prompts", ("B", "P"), _I64, "prompt token ids, left-padded with the pad token"),
        FieldSpec("responses", _RESP, _I64, "generated token ids, right-padded with the pad token"),
        FieldSpec("input_ids", _SEQ, _I64, "prompts followed by responses"),
        FieldSpec("attention_mask", _SEQ, _I64, "1 on real prompt and response tokens, 0 on padding"),
        FieldSpec("position_ids", _SEQ, _I64, "0-based position of each real token"),
        FieldSpec("response_mask", _RESP, _I64, "1 on response tokens that count in losses (through EOS)"),
        FieldSpec("old_log_probs", _RESP, _F32, "response-token log-prob under the actor before the update"),
        FieldSpec("old_log_probs_from_update", ("B",), torch.bool,
                  "old_log_probs is a placeholder: the update's first mini-batch computes it"),
        FieldSpec("ref_log_prob", _RESP, _F32, "response-token log-prob under the reference policy"),
        FieldSpec("rollout_log_probs", _RESP, _F32, "response-token log-prob reported by the rollout engine"),
        FieldSpec("values", _RESP, _F32, "critic value estimate at each response token"),
        FieldSpec("advantages", _RESP, _F32, "advantage of each response token"),
        FieldSpec("returns", _RESP, _F32, "value-function target at each response token"),
        FieldSpec("token_level_scores", _RESP, _F32, "reward-function score placed on response tokens"),
        FieldSpec("token_level_rewards", _RESP, _F32, "scores after the in-reward KL penalty"),
        FieldSpec("uid", ("B",), _OBJ, "prompt id shared by the n samples of one prompt"),
        FieldSpec("data_source", ("B",), _OBJ, "data set a sample came from; selects the reward function"),
        FieldSpec("reward_model", ("B",), _OBJ, 'per-sample dict with at least "ground_truth"'),
        FieldSpec("extra_info", ("B",), _OBJ, "the dataset row's dict (the score function's extra_info)"),
        FieldSpec("agent_num_turns", ("B",), np.dtype(np.int64), "turns of the conversation (verl's count)"),
        FieldSpec("agent_tool_rewards", ("B",), _OBJ, "list of each answered tool call's reward"),
        FieldSpec("agent_turn_scores", ("B",), _OBJ, "list of per-turn scores the loop recorded"),
    ]
}


def check_fields(batch: Batch, keys: str | Iterable[str]) -> dict[str, int]:
    """Check that `batch` holds canonical fields `keys` with the right kind, dtype and shapes.

    Shapes are checked jointly: every "B" equals len(batch), every "R" the same response length,
    and "P+R" equals P + R when both are known. Returns the bound sizes, e.g. {"B": 8, "R": 32}.
    Raises ValueError naming the missing key, or the key whose dtype/shape is wrong and the numbers.
    """
    keys = [keys] if isinstance(keys, str) else list(keys)
    for key in keys:
        if key not in FIELDS:
            raise ValueError(f"{key!r} is not a canonical field; known: {sorted(FIELDS)}")
        if key not in batch:
            raise ValueError(f"batch is missing field {key!r}: expected {FIELDS[key].describe()}")
    bound: dict[str, tuple[int, str]] = {SAMPLE_DIM: (len(batch), "len(batch)")}
    # Simple symbols first so that a compound "P+R" can be checked against (or derive) P and R.
    ordered = sorted(keys, key=lambda k: any("+" in dim for dim in FIELDS[k].shape))
    for key in ordered:
        spec, value = FIELDS[key], batch[key]
        _check_kind_and_dtype(spec, value)
        if len(value.shape) != len(spec.shape):
            raise ValueError(
                f"field {key!r} has shape {tuple(value.shape)}, expected {len(spec.shape)} dims "
                f"({', '.join(spec.shape)})"
            )
        for dim, size in zip(spec.shape, value.shape):
            _bind(bound, key, spec, dim, int(size), tuple(value.shape))
    return {symbol: size for symbol, (size, _) in bound.items()}


def _check_kind_and_dtype(spec: FieldSpec, value) -> None:
    if spec.is_tensor != isinstance(value, torch.Tensor):
        wanted = "a tensor" if spec.is_tensor else "a non-tensor numpy array"
        raise ValueError(f"field {spec.name!r} must be {wanted}, got {type(value).__name__}")
    if value.dtype != spec.dtype:
        raise ValueError(
            f"field {spec.name!r} has dtype {dtype_name(value.dtype)}, expected {dtype_name(spec.dtype)}"
        )


def _bind(bound: dict, key: str, spec: FieldSpec, dim: str, size: int, shape: tuple) -> None:
    """Bind symbol `dim` to `size`, or check it against what earlier fields bound."""

    def mismatch(expected: str) -> ValueError:
        return ValueError(
            f"field {key!r} has shape {shape}: dim {dim} = {size}, expected {expected}; "
            f"spec ({', '.join(spec.shape)})"
        )

    if "+" in dim:
        left, right = dim.split("+")
        if left in bound and right in bound:
            total = bound[left][0] + bound[right][0]
            if size != total:
                raise mismatch(f"{total} ({left} from {bound[left][1]} + {right} from {bound[right][1]})")
        elif left in bound or right in bound:
            known, unknown = (left, right) if left in bound else (right, left)
            if size < bound[known][0]:
                raise mismatch(f"at least {bound[known][0]} ({known} from {bound[known][1]})")
            bound[unknown] = (size - bound[known][0], f"{key!r} minus {known}")
    if dim in bound and bound[dim][0] != size:
        raise mismatch(f"{bound[dim][0]} (from {bound[dim][1]})")
    bound.setdefault(dim, (size, repr(key)))
