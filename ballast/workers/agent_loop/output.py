"""Finished conversations -> the rollout output contract (docs/rollout.md), plus per-sample columns.

Layout per row: the prompt LEFT-padded to width P, then the response (sampled and inserted tokens, in
order) RIGHT-padded to width R.
  * `attention_mask` is 1 on every real token, inserted tool/user tokens included: the model attends
    to them and the engine's lengths, balancing, token budgets and remove-padding see whole
    conversations;
  * `response_mask` is 1 only on sampled tokens (the loss), `rollout_log_probs` 0 where it is 0;
  * `position_ids` continue from the prompt's last position over the whole response;
  * `rollout_versions` (partial rollouts only): the weight version that sampled each response token,
    -1 on tokens the model did not sample and on padding.
P is the input's width when every conversation kept the dataset's prompt width (so a single-turn
call returns exactly what batched generation returned, prompt columns copied from the input), else
`prompt_length` (the same on every data-parallel rank, so their outputs concatenate; None: the longest
prompt). R is the response budget when `pad_to_max_response_length`, else the longest response.
`AgentRollout` is what a call hands back: these tensors and the per-sample columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDict

from ballast.workers.agent_loop.base import AgentLoopOutput

# The per-sample numbers every call reports (0 where a loop has none), so that the outputs of
# data-parallel ranks running different loops still concatenate; other info keys are not kept.
INFO_KEYS = ("model_tokens", "tool_tokens", "assistant_turns", "tool_calls", "tool_errors", "tool_timeouts",
             "malformed_tool_calls", "unknown_tool_calls", "tool_calls_dropped", "tool_latency_s",
             "tool_latency_max_s", "tokenization_mismatch", "prompt_truncated")


@dataclass
class AgentRollout:
    """One rollout call's result: the output contract, the per-sample columns, the engine steps taken."""

    tensors: TensorDict
    columns: dict[str, np.ndarray]
    engine_steps: int

    def rows(self, start: int, stop: int) -> "AgentRollout":
        return AgentRollout(self.tensors[start:stop].clone(), {k: v[start:stop] for k, v in self.columns.items()},
                            self.engine_steps)


def assemble(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             outputs: Sequence[AgentLoopOutput], *, pad_token_id: int, prompt_length: int | None,
             response_length: int | None, with_log_probs: bool) -> TensorDict:
    rows, width = input_ids.shape
    if len(outputs) != rows:
        raise ValueError(f"{len(outputs)} conversations for {rows} prompt rows")
    longest_prompt = max((len(o.prompt_ids) for o in outputs), default=0)
    prompt_width = width if longest_prompt <= width else max(prompt_length or 0, longest_prompt)
    longest = max((len(o.response_ids) for o in outputs), default=0)
    resp_width = longest if response_length is None else response_length
    if longest > resp_width:
        raise ValueError(f"a conversation has {longest} response tokens > response_length={resp_width}")
    prompts, prompt_mask, prompt_pos = _prompt_block(input_ids, attention_mask, position_ids, outputs,
                                                     prompt_width, pad_token_id)
    with_versions = any(o.token_versions is not None for o in outputs)
    ids, mask, lps, vers = [], [], [], []
    for i, out in enumerate(outputs):
        n = len(out.response_ids)
        if len(out.response_mask) != n or (with_log_probs and len(out.log_probs or ()) != n):
            raise ValueError(f"row {i}: response ids, mask and log-probs have different lengths")
        pad = resp_width - n
        ids.append([*out.response_ids, *([pad_token_id] * pad)])
        mask.append([*out.response_mask, *([0] * pad)])
        if with_log_probs:
            lps.append([*out.log_probs, *([0.0] * pad)])
        if with_versions:
            if n and (out.token_versions is not None or any(out.response_mask)):
                if out.token_versions is None or len(out.token_versions) != n:
                    raise ValueError(f"row {i}: partial rollouts need every sampled token's version (a loop that "
                                     "builds its Transcript must pass TurnOutput.versions to add_sampled)")
                vers.append([*out.token_versions, *([-1] * pad)])
            else:
                vers.append([-1] * resp_width)
    # One tensor per field from padded Python rows: a row-by-row copy into preallocated tensors
    # cost ~8 ms for 64 rows, as much as a few engine steps of the tiny model.
    responses = _rows_tensor(ids, rows, resp_width, torch.int64)
    lengths = torch.tensor([len(o.response_ids) for o in outputs], dtype=torch.int64).reshape(rows, 1)
    steps = torch.arange(1, resp_width + 1, dtype=torch.int64).unsqueeze(0)
    result = {
        "prompts": prompts, "responses": responses, "response_mask": _rows_tensor(mask, rows, resp_width, torch.int64),
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, (steps <= lengths).to(torch.int64)], dim=1),
        "position_ids": torch.cat([prompt_pos, prompt_pos[:, -1:] + steps], dim=1),
    }
    if with_log_probs:
        result["rollout_log_probs"] = _rows_tensor(lps, rows, resp_width, torch.float32)
    if with_versions:
        result["rollout_versions"] = _rows_tensor(vers, rows, resp_width, torch.int64)
    return TensorDict(result, batch_size=[rows])


def _rows_tensor(values: list[list], rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).reshape(rows, width)


def _prompt_block(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  outputs: Sequence[AgentLoopOutput], prompt_width: int, pad_token_id: int):
    """The (prompts, mask, positions) columns: a row whose conversation kept the dataset's prompt is the
    input row itself; any other row is its conversation's prompt, left-padded to `prompt_width`."""
    rows, width = input_ids.shape
    ids_rows, mask_rows = input_ids.tolist(), attention_mask.tolist()
    kept = [prompt_width == width and [t for t, m in zip(ids_rows[i], mask_rows[i]) if m] == list(out.prompt_ids)
            for i, out in enumerate(outputs)]
    if all(kept):
        return input_ids.to(torch.int64, copy=True), attention_mask.to(torch.int64, copy=True), \
            position_ids.to(torch.int64, copy=True)
    prompts = torch.full((rows, prompt_width), int(pad_token_id), dtype=torch.int64)
    prompt_mask = torch.zeros((rows, prompt_width), dtype=torch.int64)
    prompt_pos = torch.zeros((rows, prompt_width), dtype=torch.int64)
    for i, out in enumerate(outputs):
        n = len(out.prompt_ids)
        if kept[i]:
            prompts[i], prompt_mask[i], prompt_pos[i] = input_ids[i], attention_mask[i], position_ids[i]
        elif n:
            prompts[i, prompt_width - n:] = torch.tensor(out.prompt_ids, dtype=torch.int64)
            prompt_mask[i, prompt_width - n:] = 1
            prompt_pos[i, prompt_width - n:] = torch.arange(n)
    return prompts, prompt_mask, prompt_pos


def sample_columns(outputs: Sequence[AgentLoopOutput], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Per-sample numpy columns: loop name, stop reason, turns, the loop's own score (None: none), its
    tool rewards and turn scores (lists; the score function's extra_info, see ballast.data.rewards), and
    `agent_<key>` for every key of INFO_KEYS (0 where the loop did not report it)."""
    columns = {
        "agent_name": _objects(names),
        "agent_stop_reason": _objects([o.stop_reason.value for o in outputs]),
        "agent_num_turns": np.array([o.num_turns for o in outputs], dtype=np.int64),
        "agent_reward_score": _objects([o.reward_score for o in outputs]),
        "agent_tool_rewards": _objects([list(o.tool_rewards) for o in outputs]),
        "agent_turn_scores": _objects([list(o.turn_scores) for o in outputs]),
    }
    for key in INFO_KEYS:
        columns[f"agent_{key}"] = np.array([float(o.info.get(key, 0.0)) for o in outputs], dtype=np.float64)
    return columns


def _objects(values) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        column[i] = v
    return column
