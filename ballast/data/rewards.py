"""Rule-based reward functions, their registry by data_source, and loading custom ones by file path.

Every score function follows verl's convention::

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

A dict must hold a ``"score"``; its other entries are extra per-sample values (for metrics).
`validate_score` checks a returned value and turns it into a dict, naming the row on failure.

`extra_info` is the row's own ``extra_info`` plus what verl's reward managers add about the rollout
(`score_extra_info`, the keys of `ROLLOUT_EXTRA_INFO_KEYS`):

    num_turns              int: turns of the conversation, verl's count (assistant + tool/user + 1;
                           2 for a single generated answer)
    tool_rewards           list[float]: the reward of each tool call the agent loop answered, in order
    turn_scores            list[float]: per-turn scores a loop recorded (the shipped loops record none)
    rollout_reward_scores  dict: always empty (verl 0.9.1's agent loops leave it empty too)

On a name clash the rollout's value replaces the row's, as in verl.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path

from ballast.data.arithmetic import arithmetic_score
from ballast.data.code_reward import DATA_SOURCES as CODE_DATA_SOURCES
from ballast.data.code_reward import code_score
from ballast.data.tool_arithmetic import tool_arithmetic_score

ScoreFn = Callable[..., "float | dict"]

REPEAT_LENGTH_WEIGHT = 0.2


def repeat_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    *,
    length_weight: float = REPEAT_LENGTH_WEIGHT,
) -> dict:
    """Partial-credit score for the synthetic "repeat symbol S exactly K times" task, in [0, 1].

    ``ground_truth`` is S * K. On the response with surrounding whitespace stripped (length L):
    ``content = (# characters equal to S) / L`` and ``closeness = min(L, K) / max(L, K)``
    (both 0 for an empty response), and ``score = (w + (1 - w) * content) * closeness`` with
    ``w = length_weight``. The score is 1 only for exactly S * K; a response of the right length
    but wrong characters earns w; K/2 copies of S earn 0.5. Returns
    ``{"score", "content", "closeness"}``.
    """
    if not isinstance(ground_truth, str) or not ground_truth or len(set(ground_truth)) != 1:
        raise ValueError(f"repeat ground_truth must be one character repeated, got {ground_truth!r}")
    if not 0.0 <= length_weight <= 1.0:
        raise ValueError(f"length_weight must be in [0, 1], got {length_weight}")
    symbol, count = ground_truth[0], len(ground_truth)
    response = solution_str.strip()
    length = len(response)
    if length == 0:
        return {"score": 0.0, "content": 0.0, "closeness": 0.0}
    content = response.count(symbol) / length
    closeness = min(length, count) / max(length, count)
    score = (length_weight + (1.0 - length_weight) * content) * closeness
    return {"score": float(score), "content": float(content), "closeness": float(closeness)}


_NUMBER = re.compile(r"-?[\d,]*\.?\d+")
_AFTER_HASHES = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def extract_gsm8k_answer(text: str, method: str = "flexible") -> str | None:
    """The final answer in `text` as a normalised number string, or None.

    "strict": only the number after the last ``####``. "flexible": that number if present, else the
    last number anywhere in the text. Commas and a trailing ``.0`` style fraction are normalised so
    that "1,000" and "1000.00" both give "1000".
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    marked = _AFTER_HASHES.findall(text)
    if marked:
        return _normalise_number(marked[-1])
    if method == "strict":
        return None
    numbers_found = [n for n in _NUMBER.findall(text) if any(ch.isdigit() for ch in n)]
    return _normalise_number(numbers_found[-1]) if numbers_found else None


def _normalise_number(raw: str) -> str | None:
    cleaned = raw.replace(",", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def gsm8k_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    *,
    method: str = "flexible",
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """Exact-answer reward: `correct_score` if the extracted final answer equals `ground_truth`
    (compared as numbers), `format_score` if an answer was found but is wrong, else 0.0."""
    answer = extract_gsm8k_answer(solution_str, method=method)
    if answer is None:
        return 0.0
    expected = _normalise_number(str(ground_truth).strip())
    if expected is None:
        raise ValueError(f"gsm8k ground_truth must be a number, got {ground_truth!r}")
    return float(correct_score) if answer == expected else float(format_score)


_REGISTRY: dict[str, ScoreFn] = {
    "ballast/repeat": repeat_score,
    "openai/gsm8k": gsm8k_score,
    "ballast/arithmetic": arithmetic_score,
    "ballast/tool_arithmetic": tool_arithmetic_score,
    **{source: code_score for source in CODE_DATA_SOURCES},  # programs run against tests in the sandbox
}


def register_reward_fn(data_source: str, fn: ScoreFn, *, overwrite: bool = False) -> None:
    """Make `fn` the score function for rows whose data_source is `data_source`."""
    if not callable(fn):
        raise TypeError(f"reward function for {data_source!r} must be callable, got {type(fn).__name__}")
    if data_source in _REGISTRY and not overwrite:
        raise ValueError(f"data_source {data_source!r} already has a reward function; pass overwrite=True")
    _REGISTRY[data_source] = fn


def get_reward_fn(data_source: str) -> ScoreFn:
    """The registered score function for `data_source` (ValueError listing the known ones)."""
    try:
        return _REGISTRY[data_source]
    except KeyError:
        raise ValueError(
            f"no reward function registered for data_source {data_source!r}; known: {sorted(_REGISTRY)}; "
            "set custom_reward_function.path/name or register one"
        ) from None


def registered_data_sources() -> list[str]:
    return sorted(_REGISTRY)


def default_compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None):
    """Dispatch to the registered function for `data_source` (verl's default_compute_score role)."""
    return get_reward_fn(data_source)(data_source, solution_str, ground_truth, extra_info)


ROLLOUT_EXTRA_INFO_KEYS = ("num_turns", "tool_rewards", "turn_scores", "rollout_reward_scores")


def score_extra_info(extra_info: Mapping | None, *, num_turns: int, tool_rewards: Sequence[float],
                     turn_scores: Sequence[float]) -> dict:
    """The `extra_info` a score function receives for one sample: a copy of the row's `extra_info`
    (None: none) with the rollout's keys (module docstring) set over it. The row's dict is not
    changed, so the n samples of one prompt, which share it, each see their own conversation."""
    if extra_info is not None and not isinstance(extra_info, Mapping):
        raise TypeError(f"extra_info must be a dict, got {type(extra_info).__name__} {extra_info!r}")
    return {**(extra_info or {}), "num_turns": int(num_turns), "tool_rewards": [float(r) for r in tool_rewards],
            "turn_scores": [float(s) for s in turn_scores], "rollout_reward_scores": {}}


def validate_score(value, *, index: int, data_source: str) -> dict:
    """Check one score function result; returns it as a dict with a float ``"score"``.

    Accepted: a finite real number (not bool), or a dict whose ``"score"`` is one. Anything else is a
    ValueError naming the row `index` and `data_source`.
    """
    where = f"row {index} (data_source {data_source!r})"
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward for {where} is a dict without a 'score' key: keys {sorted(value)}")
        return {**value, "score": _finite(value["score"], where)}
    return {"score": _finite(value, where)}


def _finite(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"reward for {where} must be a finite number, got {type(value).__name__} {value!r}")
    as_float = float(value)
    if not math.isfinite(as_float):
        raise ValueError(f"reward for {where} must be finite, got {as_float}")
    return as_float


def load_custom_reward_fn(path: str | os.PathLike, name: str = "compute_score", **kwargs) -> ScoreFn:
    """Import `name` from the Python file at `path` (``custom_reward_function.path/name``).

    `kwargs`, if any, are bound with functools.partial (verl's ``reward_kwargs``). The module is
    registered in sys.modules under a name derived from the absolute path, so classes and dataclasses
    defined in it work; shipping the function to another process needs the file there too.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"custom reward file {str(file)!r} does not exist")
    digest = hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:10]
    module_name = f"ballast_custom_reward_{file.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"custom reward file {str(file)!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(module_name, None)
        raise ImportError(f"importing custom reward file {str(file)!r} failed: {type(err).__name__}: {err}") from err
    if not hasattr(module, name):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"custom reward file {str(file)!r} has no function {name!r}; callables there: {public}")
    fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"{name!r} in custom reward file {str(file)!r} is a {type(fn).__name__}, not a function")
    return functools.partial(fn, **kwargs) if kwargs else fn
