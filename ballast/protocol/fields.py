"""The canonical Batch columns: shape, dtype, who writes and who reads each, and what it means.

Symbolic dimensions: B = samples in the batch, P = prompt length (left-padded), R = response
length (right-padded), "P+R" = full sequence (the prompt alone, width P, before the rollout).
`FIELDS` is the table: every column that code writes into a step's Batch, and nothing else
(tests/unit/protocol/test_batch_columns.py runs the writers and compares what they write with it).
`check_fields` checks that a Batch carries the named fields with the right kind, dtype and mutually
consistent shapes, and is meant to be called where a Batch enters a worker or an algorithm, so that
a misnamed or misshaped field fails there with its name rather than as a broadcast error deep in a
loss function. `columns_read_by` is how a worker learns which columns a loss needs.

Writers: data = the prompt collator and the driver's uids; rollout = the rollout output contract
(every backend and the agent loops' `assemble`); agent loop = its per-sample columns; actor = the
old-log-prob pass or the update that computed them; ref, critic = their inference passes; reward,
advantages, correction = the driver's phases (`ballast.trainer.step`). Readers also: engine = every
forward (the sequence layout); actor loss, critic loss = what the engine hands the loss; planner =
the step's plans; sampling = dynamic sampling's group filter; padding = `protocol.padding`;
metrics = the step's and validation's metrics.

| key | shape | dtype | written by | read by | meaning |
|---|---|---|---|---|---|
| prompts | (B, P) | int64 | rollout | rollout, padding | prompt token ids, left-padded with the pad token |
| responses | (B, R) | int64 | rollout | engine, reward, planner, padding, metrics | generated token ids, right-padded with the pad token |
| input_ids | (B, P+R) | int64 | data, rollout | rollout, engine, planner | prompts followed by responses |
| attention_mask | (B, P+R) | int64 | data, rollout | rollout, engine, reward, planner, metrics | 1 on real prompt and response tokens, 0 on padding |
| position_ids | (B, P+R) | int64 | data, rollout | rollout, engine, planner | 0-based position of each real token |
| response_mask | (B, R) | int64 | rollout, correction | engine, actor loss, critic loss, reward, advantages, correction, metrics | 1 on response tokens that count in losses, 0 elsewhere |
| rollout_log_probs | (B, R) | float32 | rollout | actor loss, advantages, correction, metrics | response-token log-prob reported by the rollout engine (bypass correction: the old policy's) |
| rollout_versions | (B, R) | int64 | rollout | metrics | partial rollouts: weight version that sampled each token, -1 else |
| old_log_probs | (B, R) | float32 | actor | actor loss, advantages, correction, metrics | response-token log-prob under the actor before the update (never the rollout's) |
| entropy | (B, R) | float32 | actor | metrics | actor's entropy at each response token, before the update |
| ref_log_prob | (B, R) | float32 | ref | actor loss, advantages | response-token log-prob under the reference policy |
| values | (B, R) | float32 | critic | critic loss, advantages, metrics | critic value estimate at each response token |
| token_level_scores | (B, R) | float32 | reward | advantages, sampling, metrics | reward-function score placed on response tokens |
| token_level_rewards | (B, R) | float32 | advantages | metrics | scores after the in-reward KL penalty |
| advantages | (B, R) | float32 | advantages | actor loss, metrics | advantage of each response token |
| returns | (B, R) | float32 | advantages | critic loss, metrics | value-function target at each response token |
| rollout_is_weights | (B, R) | float32 | correction | actor loss | decoupled correction: importance weight of each token |
| rollout_is_norm_sum | (B,) | float64 | correction | actor loss, correction | the row's numerator term of the weights' batch mean |
| rollout_is_norm_count | (B,) | float64 | correction | actor loss, correction | the row's count term of the weights' batch mean |
| train_log_probs | (B, R) | float32 | correction | metrics | bypass mode: log-probs each row had when it was trained |
| uid | (B,) | object | data | advantages, planner, sampling, metrics | prompt id shared by the n samples of one prompt |
| data_source | (B,) | object | data | reward, metrics | data set a sample came from; selects the reward function |
| reward_model | (B,) | object | data | reward | the row's dict with at least "ground_truth" |
| ground_truth | (B,) | object | data | reward | reward_model["ground_truth"] |
| extra_info | (B,) | object | data | reward, agent loop | the row's dict (the score function's extra_info) |
| index | (B,) | object | data | reward | extra_info["index"], else the row number |
| ability | (B,) | object | data | - | the row's ability label (verl's column) |
| raw_prompt | (B,) | object | data | agent loop | the row's chat messages |
| agent_name | (B,) | object | data, agent loop | agent loop | agent loop the row asks for (data), then the one that ran |
| agent_stop_reason | (B,) | object | agent loop | metrics | why the conversation ended |
| agent_num_turns | (B,) | int64 | agent loop | reward, metrics | turns of the conversation (verl's count) |
| agent_reward_score | (B,) | object | agent loop | reward | a score the loop computed itself (None: none) |
| agent_tool_rewards | (B,) | object | agent loop | reward | list of each answered tool call's reward |
| agent_turn_scores | (B,) | object | agent loop | reward | list of per-turn scores the loop recorded |
| agent_model_tokens | (B,) | float64 | agent loop | metrics | response tokens the model sampled |
| agent_tool_tokens | (B,) | float64 | agent loop | metrics | response tokens inserted (tool results, user turns, template) |
| agent_assistant_turns | (B,) | float64 | agent loop | metrics | model turns of the conversation |
| agent_tool_calls | (B,) | float64 | agent loop | metrics | tool calls answered (run, or refused with an error message) |
| agent_tool_errors | (B,) | float64 | agent loop | metrics | answered tool calls that failed |
| agent_tool_timeouts | (B,) | float64 | agent loop | metrics | tool calls that ran out of time |
| agent_malformed_tool_calls | (B,) | float64 | agent loop | metrics | tool calls that did not parse |
| agent_unknown_tool_calls | (B,) | float64 | agent loop | metrics | calls naming a tool the loop does not offer |
| agent_tool_calls_dropped | (B,) | float64 | agent loop | metrics | calls beyond the loop's max_parallel_calls |
| agent_tool_latency_s | (B,) | float64 | agent loop | metrics | seconds the tool calls took, summed |
| agent_tool_latency_max_s | (B,) | float64 | agent loop | metrics | seconds of the slowest tool call |
| agent_tokenization_mismatch | (B,) | float64 | agent loop | metrics | 1 when the tokens differ from the chat template's rendering |
| agent_prompt_truncated | (B,) | float64 | agent loop | - | 1 when the prompt was cut to the prompt length |

Non-tensor fields are numpy arrays (int64 and float64 ones too). A prompt-only Batch (the data's)
holds input_ids, attention_mask and position_ids of width P and the data's non-tensor columns; the
rollout returns the sequence layout and keeps the prompts' other columns.
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

# Who writes a column and who reads it (the table's last columns; the module docstring says what each is).
DATA, ROLLOUT, AGENT_LOOP, ACTOR, REF, CRITIC = "data", "rollout", "agent loop", "actor", "ref", "critic"
REWARD, ADVANTAGES, CORRECTION = "reward", "advantages", "correction"
ENGINE, ACTOR_LOSS, CRITIC_LOSS = "engine", "actor loss", "critic loss"
PLANNER, SAMPLING, PADDING, METRICS = "planner", "sampling", "padding", "metrics"
WRITERS = (DATA, ROLLOUT, AGENT_LOOP, ACTOR, REF, CRITIC, REWARD, ADVANTAGES, CORRECTION)
READERS = (DATA, ROLLOUT, AGENT_LOOP, ENGINE, ACTOR_LOSS, CRITIC_LOSS, REWARD, ADVANTAGES, CORRECTION, PLANNER,
           SAMPLING, PADDING, METRICS)


@dataclass(frozen=True)
class FieldSpec:
    """One canonical field: symbolic shape, dtype (torch dtype: a tensor; numpy dtype: a non-tensor),
    meaning, and the writers / readers of the module docstring (no reader: carried along, unread)."""

    name: str
    shape: tuple[str, ...]
    dtype: torch.dtype | np.dtype
    meaning: str
    written_by: tuple[str, ...] = ()
    read_by: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [w for w in self.written_by if w not in WRITERS] + [r for r in self.read_by if r not in READERS]
        if unknown or not self.written_by:
            raise ValueError(f"field {self.name!r}: writers {self.written_by} / readers {self.read_by} must be "
                             f"among {WRITERS} / {READERS} (at least one writer); unknown: {unknown}")

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.dtype, torch.dtype)

    def describe(self) -> str:
        kind = "tensor" if self.is_tensor else "non-tensor"
        return f"({', '.join(self.shape)}) {dtype_name(self.dtype)} {kind}: {self.meaning}"


_I64, _F32, _F64, _OBJ = torch.int64, torch.float32, torch.float64, np.dtype(object)
_SEQ, _RESP, _ROW = ("B", "P+R"), ("B", "R"), ("B",)

# The agent loop's per-sample numbers (`agent_<key>`, float64, 0 where a loop has none); the metrics
# read all of them but `prompt_truncated`.
_AGENT_NUMBERS = {
    "model_tokens": "response tokens the model sampled",
    "tool_tokens": "response tokens inserted (tool results, user turns, template)",
    "assistant_turns": "model turns of the conversation",
    "tool_calls": "tool calls answered (run, or refused with an error message)",
    "tool_errors": "answered tool calls that failed",
    "tool_timeouts": "tool calls that ran out of time",
    "malformed_tool_calls": "tool calls that did not parse",
    "unknown_tool_calls": "calls naming a tool the loop does not offer",
    "tool_calls_dropped": "calls beyond the loop's max_parallel_calls",
    "tool_latency_s": "seconds the tool calls took, summed",
    "tool_latency_max_s": "seconds of the slowest tool call",
    "tokenization_mismatch": "1 when the tokens differ from the chat template's rendering",
    "prompt_truncated": "1 when the prompt was cut to the prompt length",
}

FIELDS: dict[str, FieldSpec] = {
    spec.name: spec
    for spec in [
        FieldSpec("prompts", ("B", "P"), _I64, "prompt token ids, left-padded with the pad token",
                  (ROLLOUT,), (ROLLOUT, PADDING)),
        FieldSpec("responses", _RESP, _I64, "generated token ids, right-padded with the pad token",
                  (ROLLOUT,), (ENGINE, REWARD, PLANNER, PADDING, METRICS)),
        FieldSpec("input_ids", _SEQ, _I64, "prompts followed by responses",
                  (DATA, ROLLOUT), (ROLLOUT, ENGINE, PLANNER)),
        FieldSpec("attention_mask", _SEQ, _I64, "1 on real prompt and response tokens, 0 on padding",
                  (DATA, ROLLOUT), (ROLLOUT, ENGINE, REWARD, PLANNER, METRICS)),
        FieldSpec("position_ids", _SEQ, _I64, "0-based position of each real token",
                  (DATA, ROLLOUT), (ROLLOUT, ENGINE, PLANNER)),
        FieldSpec("response_mask", _RESP, _I64, "1 on response tokens that count in losses, 0 elsewhere",
                  (ROLLOUT, CORRECTION),
                  (ENGINE, ACTOR_LOSS, CRITIC_LOSS, REWARD, ADVANTAGES, CORRECTION, METRICS)),
        FieldSpec("rollout_log_probs", _RESP, _F32,
                  "response-token log-prob reported by the rollout engine (bypass correction: the old policy's)",
                  (ROLLOUT,), (ACTOR_LOSS, ADVANTAGES, CORRECTION, METRICS)),
        FieldSpec("rollout_versions", _RESP, _I64, "partial rollouts: weight version that sampled each token, -1 else",
                  (ROLLOUT,), (METRICS,)),
        FieldSpec("old_log_probs", _RESP, _F32,
                  "response-token log-prob under the actor before the update (never the rollout's)",
                  (ACTOR,), (ACTOR_LOSS, ADVANTAGES, CORRECTION, METRICS)),
        FieldSpec("entropy", _RESP, _F32, "actor's entropy at each response token, before the update",
                  (ACTOR,), (METRICS,)),
        FieldSpec("ref_log_prob", _RESP, _F32, "response-token log-prob under the reference policy",
                  (REF,), (ACTOR_LOSS, ADVANTAGES)),
        FieldSpec("values", _RESP, _F32, "critic value estimate at each response token",
                  (CRITIC,), (CRITIC_LOSS, ADVANTAGES, METRICS)),
        FieldSpec("token_level_scores", _RESP, _F32, "reward-function score placed on response tokens",
                  (REWARD,), (ADVANTAGES, SAMPLING, METRICS)),
        FieldSpec("token_level_rewards", _RESP, _F32, "scores after the in-reward KL penalty",
                  (ADVANTAGES,), (METRICS,)),
        FieldSpec("advantages", _RESP, _F32, "advantage of each response token",
                  (ADVANTAGES,), (ACTOR_LOSS, METRICS)),
        FieldSpec("returns", _RESP, _F32, "value-function target at each response token",
                  (ADVANTAGES,), (CRITIC_LOSS, METRICS)),
        FieldSpec("rollout_is_weights", _RESP, _F32, "decoupled correction: importance weight of each token",
                  (CORRECTION,), (ACTOR_LOSS,)),
        FieldSpec("rollout_is_norm_sum", _ROW, _F64, "the row's numerator term of the weights' batch mean",
                  (CORRECTION,), (ACTOR_LOSS, CORRECTION)),
        FieldSpec("rollout_is_norm_count", _ROW, _F64, "the row's count term of the weights' batch mean",
                  (CORRECTION,), (ACTOR_LOSS, CORRECTION)),
        FieldSpec("train_log_probs", _RESP, _F32, "bypass mode: log-probs each row had when it was trained",
                  (CORRECTION,), (METRICS,)),
        FieldSpec("uid", _ROW, _OBJ, "prompt id shared by the n samples of one prompt",
                  (DATA,), (ADVANTAGES, PLANNER, SAMPLING, METRICS)),
        FieldSpec("data_source", _ROW, _OBJ, "data set a sample came from; selects the reward function",
                  (DATA,), (REWARD, METRICS)),
        FieldSpec("reward_model", _ROW, _OBJ, 'the row\'s dict with at least "ground_truth"', (DATA,), (REWARD,)),
        FieldSpec("ground_truth", _ROW, _OBJ, 'reward_model["ground_truth"]', (DATA,), (REWARD,)),
        FieldSpec("extra_info", _ROW, _OBJ, "the row's dict (the score function's extra_info)",
                  (DATA,), (REWARD, AGENT_LOOP)),
        FieldSpec("index", _ROW, _OBJ, 'extra_info["index"], else the row number', (DATA,), (REWARD,)),
        FieldSpec("ability", _ROW, _OBJ, "the row's ability label (verl's column)", (DATA,), ()),
        FieldSpec("raw_prompt", _ROW, _OBJ, "the row's chat messages", (DATA,), (AGENT_LOOP,)),
        FieldSpec("agent_name", _ROW, _OBJ, "agent loop the row asks for (data), then the one that ran",
                  (DATA, AGENT_LOOP), (AGENT_LOOP,)),
        FieldSpec("agent_stop_reason", _ROW, _OBJ, "why the conversation ended", (AGENT_LOOP,), (METRICS,)),
        FieldSpec("agent_num_turns", _ROW, np.dtype(np.int64), "turns of the conversation (verl's count)",
                  (AGENT_LOOP,), (REWARD, METRICS)),
        FieldSpec("agent_reward_score", _ROW, _OBJ, "a score the loop computed itself (None: none)",
                  (AGENT_LOOP,), (REWARD,)),
        FieldSpec("agent_tool_rewards", _ROW, _OBJ, "list of each answered tool call's reward",
                  (AGENT_LOOP,), (REWARD,)),
        FieldSpec("agent_turn_scores", _ROW, _OBJ, "list of per-turn scores the loop recorded",
                  (AGENT_LOOP,), (REWARD,)),
        *(FieldSpec(f"agent_{key}", _ROW, np.dtype(np.float64), meaning, (AGENT_LOOP,),
                    () if key == "prompt_truncated" else (METRICS,))
          for key, meaning in _AGENT_NUMBERS.items()),
    ]
}


def columns_read_by(reader: str) -> tuple[str, ...]:
    """The tensor columns `reader` (e.g. ACTOR_LOSS) reads, in table order: what a worker hands it."""
    if reader not in READERS:
        raise ValueError(f"unknown reader {reader!r}; known: {READERS}")
    return tuple(name for name, spec in FIELDS.items() if spec.is_tensor and reader in spec.read_by)


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
