"""Rule rewards on the driver: decode each response, score it, place the score on its last token.

The score function is the built-in one for the sample's `data_source` (see `ballast.data.rewards`) or
`custom_reward_function.path/name`. A function that raises or returns something that is not a finite
number (or a dict with a "score") is a `RewardFunctionError` naming the training step, the sample's
dataset row (its `index`), data source and what the function returned; nothing is skipped. The
function's own exception is kept as the cause, so the command line prints its traceback.

`reward_model.reward_manager` picks what is recorded besides the score, as verl's managers of the
same names do. `naive`: every numeric value of a dict result except "score" itself (and a string
`pred`). `dapo`: a plain number is also recorded as `acc` (so `algorithm.filter_groups.metric=acc`
and validation's core variable `acc` work with a score function that returns a number), and a dict
result is recorded whole, "score" included. `acc` is the score before the overlong penalty, as in
verl. Only the `dapo` manager applies `reward_model.overlong_buffer` (verl's `naive` ignores it, so
the config refuses that combination instead).

The function's `extra_info` is the row's own plus verl's rollout keys (`num_turns`, `tool_rewards`,
`turn_scores`, `rollout_reward_scores`; `ballast.data.rewards.score_extra_info`), read from the agent
loop's columns; a batch without them (built by hand) holds single generated answers: 2 turns, no
tool rewards. A row whose own extra_info has one of those keys gets the rollout's value instead, as in
verl, with a warning once per key.

`reward.timeout_s` bounds one call: the function then runs on a helper thread and a call that does
not return in time stops the run (a hung score function would otherwise hang the run, and no worker
timeout covers the driver). `reward.timeout_s=null` runs it on the main thread without a limit, for
functions that need the main thread (e.g. ones that use `signal.alarm` themselves).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch

from ballast.data import (
    ROLLOUT_EXTRA_INFO_KEYS, default_compute_score, load_custom_reward_fn, score_extra_info, validate_score,
)
from ballast.protocol import Batch, check_fields

logger = logging.getLogger(__name__)

# verl's count for a prompt and one generated answer (its single-turn agent loop's num_turns)
SINGLE_ANSWER_NUM_TURNS = 2
AGENT_TURN_COLUMNS = ("agent_num_turns", "agent_tool_rewards", "agent_turn_scores")


class RewardFunctionError(ValueError):
    """The score function raised, or returned something that is not a finite score."""


@dataclass(frozen=True)
class OverlongBuffer:
    """DAPO's soft overlong punishment: a response longer than max_response_length - buffer_len loses
    penalty_factor * (excess / buffer_len) of reward (linear, reaching -penalty_factor at the limit)."""

    max_response_length: int
    buffer_len: int
    penalty_factor: float
    log: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.buffer_len <= self.max_response_length:
            raise ValueError(f"reward_model.overlong_buffer.len={self.buffer_len} must be in (0, "
                             f"data.max_response_length={self.max_response_length}]")

    def penalty(self, response_length: int) -> float:
        excess = response_length - (self.max_response_length - self.buffer_len)
        return min(-excess / self.buffer_len * self.penalty_factor, 0.0)


class RewardTimeoutError(RewardFunctionError):
    """One call of the score function did not return within `reward.timeout_s`."""


class _TimedCaller:
    """Runs calls on one daemon thread and waits for each at most `timeout_s`. A call that never
    returns leaves its thread behind (Python cannot stop it); the run ends anyway, and a daemon
    thread does not keep the process alive."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._calls: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def _serve(self) -> None:
        while True:
            fn, args, done = self._calls.get()
            try:
                done.put((True, fn(*args)))
            except BaseException as err:  # handed to the caller, who re-raises it
                done.put((False, err))

    def __call__(self, fn: Callable, *args):
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._serve, name="ballast-reward", daemon=True)
            self._thread.start()
        done: "queue.Queue" = queue.Queue(maxsize=1)
        self._calls.put((fn, args, done))
        try:
            ok, value = done.get(timeout=self.timeout_s)
        except queue.Empty:
            self._thread = None  # the stuck thread keeps the old queue; a later call gets a fresh thread
            self._calls = queue.Queue()
            raise TimeoutError from None
        if not ok:
            raise value
        return value


REWARD_MANAGERS = ("naive", "dapo")


class RewardManager:
    def __init__(self, tokenizer, compute_score: Optional[Callable] = None, reward_fn_key: str = "data_source",
                 overlong: Optional[OverlongBuffer] = None, timeout_s: Optional[float] = None,
                 manager: str = "naive", name: Optional[str] = None):
        """`name`: how messages call the score function (a custom one: its name and file)."""
        if manager not in REWARD_MANAGERS:
            raise ValueError(f"reward_model.reward_manager={manager!r} is not one of {list(REWARD_MANAGERS)}")
        self.manager = manager
        self.tokenizer = tokenizer
        self.fn_name = f"reward function {name}" if name else "reward function"
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key
        self.overlong = overlong
        self.timeout_s = timeout_s
        self._call = _TimedCaller(timeout_s) if timeout_s is not None else (lambda fn, *args: fn(*args))
        # One batch at a time: with off-policy overlap a generated-ahead batch is scored on the rollout
        # pipeline's thread while validation may score on the main thread.
        self._busy = threading.Lock()
        self._warned_clashes: set = set()

    @classmethod
    def from_config(cls, tokenizer, path: Optional[str], name: str, reward_fn_key: str,
                    overlong: Optional[OverlongBuffer] = None,
                    timeout_s: Optional[float] = None, manager: str = "naive") -> "RewardManager":
        fn = load_custom_reward_fn(path, name) if path else None
        return cls(tokenizer, fn, reward_fn_key, overlong, timeout_s, manager,
                   name=f"{name!r} in {str(path)!r}" if path else None)

    def __call__(self, batch: Batch, step: Optional[int] = None) -> Tuple[torch.Tensor, Dict[str, np.ndarray]]:
        """(token_level_scores (B, R) float32, extra per-sample values returned by the score function).

        `step` (the training step, None for validation) only goes into error messages."""
        with self._busy:
            return self._score_batch(batch, step)

    def _score_batch(self, batch: Batch, step: Optional[int]) -> Tuple[torch.Tensor, Dict[str, np.ndarray]]:
        responses, mask = batch["responses"], batch["response_mask"]
        # The response's real tokens (sampled and, in multi-turn rollouts, inserted tool/user tokens:
        # the score function reads the whole conversation, as in verl); the score goes on the last
        # SAMPLED token, so every estimator sees it under the response mask.
        width = responses.shape[-1]
        real = batch["attention_mask"][:, -width:] if "attention_mask" in batch else mask
        lengths = real.sum(dim=-1).tolist()
        last_sampled = _last_sampled(mask)
        own = batch["agent_reward_score"] if "agent_reward_score" in batch else None
        sources = batch[self.reward_fn_key] if self.reward_fn_key in batch else np.array(["unknown"] * len(batch))
        truths = batch["ground_truth"] if "ground_truth" in batch else [
            (rm or {}).get("ground_truth") for rm in batch["reward_model"]]
        rows = batch["index"] if "index" in batch else None
        extra_infos = self._extra_infos(batch, rows)
        scores = torch.zeros(responses.shape, dtype=torch.float32)
        extras: Dict[str, list] = defaultdict(list)
        for i, length in enumerate(lengths):
            text = self.tokenizer.decode(responses[i, :length].tolist(), skip_special_tokens=True)
            where = _where(step, i, rows[i] if rows is not None else None, sources[i])
            try:
                if own is not None and own[i] is not None:  # the agent loop scored the sample itself
                    raw = float(own[i])
                else:
                    raw = self._call(self.compute_score, sources[i], text, truths[i], extra_infos[i])
            except TimeoutError:
                raise RewardTimeoutError(
                    f"{self.fn_name} did not return within reward.timeout_s={self.timeout_s:g}s on {where}; "
                    "fix the function or raise reward.timeout_s"
                ) from None
            except Exception as err:
                raise RewardFunctionError(f"{self.fn_name} failed on {where}: {type(err).__name__}: {err}") from err
            try:
                result = validate_score(raw, index=i, data_source=str(sources[i]))
            except ValueError as err:
                raise RewardFunctionError(f"{self.fn_name} returned an unusable result on {where}: {err}") from None
            score = result["score"]
            self._record(extras, result, returned_number=not isinstance(raw, dict))
            if self.overlong is not None:
                penalty = self.overlong.penalty(length)
                score += penalty
                if self.overlong.log:
                    extras["overlong_reward"].append(penalty)
                    extras["overlong"].append(float(penalty < 0))
            if last_sampled[i] >= 0:
                scores[i, last_sampled[i]] = score
        return scores, {k: np.asarray(v) for k, v in extras.items() if len(v) == len(lengths)}

    def _extra_infos(self, batch: Batch, rows) -> list:
        """Each sample's `extra_info` for the score function (module docstring)."""
        n = len(batch)
        own = batch["extra_info"] if "extra_info" in batch else [None] * n
        if "agent_num_turns" in batch:
            check_fields(batch, AGENT_TURN_COLUMNS)
            turns, tool_rewards, turn_scores = (batch[k] for k in AGENT_TURN_COLUMNS)
        else:  # no agent columns: one generated answer per prompt
            turns, tool_rewards, turn_scores = [SINGLE_ANSWER_NUM_TURNS] * n, [()] * n, [()] * n
        for i, info in enumerate(own):
            for key in set(info or ()) & set(ROLLOUT_EXTRA_INFO_KEYS) - self._warned_clashes:
                self._warned_clashes.add(key)
                where = f"dataset row {rows[i]}" if rows is not None else f"batch position {i}"
                logger.warning("%s: extra_info[%r] is replaced by the rollout's %r for the score function "
                               "(as in verl); rename the dataset's key to keep it", where, key, key)
        return [score_extra_info(own[i], num_turns=turns[i], tool_rewards=tool_rewards[i],
                                 turn_scores=turn_scores[i]) for i in range(n)]

    def _record(self, extras: Dict[str, list], result: dict, returned_number: bool) -> None:
        """The per-sample values this manager keeps from one score-function result (module docstring)."""
        if self.manager == "dapo" and returned_number:
            extras["acc"].append(result["score"])
            return
        for key, value in result.items():
            if key == "score" and self.manager != "dapo":
                continue
            if isinstance(value, (int, float)):
                extras[key].append(float(value))
            elif key == "pred" and isinstance(value, str):  # the answer a majority vote counts (maj@n)
                extras[key].append(value)


def _last_sampled(mask: torch.Tensor) -> list:
    """Column of each row's last response-mask-1 token (-1 for a row without any)."""
    cols = torch.arange(mask.shape[-1]).expand_as(mask)
    return torch.where(mask.bool(), cols, torch.full_like(cols, -1)).max(dim=-1).values.tolist()


def _where(step: Optional[int], position: int, row, source) -> str:
    """Where a sample comes from, for messages: the step, its dataset row index and data_source."""
    when = f"step {step}" if step is not None else "validation"
    if row is None:
        return f"{when}, batch position {position} (data_source {source!r})"
    return f"{when}, dataset row {row} (data_source {source!r}, batch position {position})"
