"""The agent-loop interface: one conversation in, its token-exact training sequence out.

    @register("my_agent")
    class MyLoop(AgentLoop):
        async def run(self, sample: AgentSample) -> AgentLoopOutput:
            t = Transcript(sample.prompt_ids)
            out = await self.ctx.engine.generate(TurnRequest(t.ids, self.ctx.budget(t), sample.seed(0)))
            t.add_sampled(out.token_ids, out.log_probs, out.versions)
            return t.output(StopReason.ANSWER, assistant_turns=1)

A loop sees the sample (prompt ids, chat messages, extra_info), an `AgentContext` (the asynchronous
engine, the chat format, the tool executor, the budgets) and builds a `Transcript`: sampled ids with
their log-probs and response_mask 1, inserted ids (tool results, user turns, template glue) with
mask 0 and log-prob 0. Loops are picked per sample by `agent_name` (verl's data column) or the
configured default, and instantiated once per rollout call.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ballast.tools import ToolExecutor
from ballast.workers.agent_loop.chat import ChatFormat
from ballast.workers.agent_loop.config import MultiTurnConfig
from ballast.workers.rollout.base import SamplingConfig


class StopReason(str, enum.Enum):
    """Why a conversation ended (recorded per sample; the step logs the fraction of each)."""

    ANSWER = "answer"                    # the model's turn ended (stop token) without a tool call
    LENGTH = "length"                    # the response budget (rollout.response_length) is used up
    MAX_ASSISTANT_TURNS = "max_assistant_turns"
    MAX_USER_TURNS = "max_user_turns"


STOP_REASONS = tuple(r.value for r in StopReason)


@dataclass
class AgentSample:
    """One row of a rollout call as a loop sees it."""

    row: int
    prompt_ids: list[int]                 # the dataset's tokenised prompt (real tokens, no padding)
    messages: list[dict] | None           # the raw chat messages (`raw_prompt`), when the data has them
    extra_info: dict = field(default_factory=dict)
    seed: Callable[[int], int | None] = lambda turn: None  # sampling seed of each turn


@dataclass
class AgentLoopOutput:
    """A finished conversation: prompt ids, response ids (sampled + inserted), the mask, log-probs."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    log_probs: list[float] | None
    stop_reason: StopReason
    num_turns: int                        # verl's count: assistant turns + tool/user turns + 1
    info: dict[str, float] = field(default_factory=dict)  # per-sample numbers for the step's metrics
    reward_score: float | None = None     # a score the loop computed itself (None: the reward function's)
    token_versions: list[int] | None = None  # partial rollouts: per response token, the weight version that
    #                                          sampled it (-1 on inserted tokens); None: the call's weights
    # verl's per-conversation lists, handed to the score function in extra_info (ballast.data.rewards):
    tool_rewards: list[float] = field(default_factory=list)  # each answered tool call's reward, in order
    turn_scores: list[float] = field(default_factory=list)   # per-turn scores (e.g. of a simulated user)


class Transcript:
    """The growing token sequence of one conversation, with its mask and log-probs kept aligned."""

    def __init__(self, prompt_ids: Sequence[int], with_log_probs: bool = True):
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.mask: list[int] = []
        self.log_probs: list[float] | None = [] if with_log_probs else None
        self.versions: list[int] = []
        self._any_version = False

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def __len__(self) -> int:
        return len(self.response_ids)

    def add_sampled(self, ids: Sequence[int], log_probs: Sequence[float] | None,
                    versions: Sequence[int] | None = None) -> None:
        """Append a turn's sampled ids; `versions` is the turn's `TurnOutput.versions` (partial rollouts)."""
        if versions is not None and len(versions) != len(ids):
            raise ValueError(f"{len(ids)} sampled ids need as many versions, got {len(versions)}")
        if self.log_probs is not None:
            if log_probs is None or len(log_probs) != len(ids):
                raise ValueError(f"{len(ids)} sampled ids need as many log-probs, got "
                                 f"{None if log_probs is None else len(log_probs)}")
            self.log_probs.extend(map(float, log_probs))
        self.response_ids.extend(map(int, ids))
        self.mask.extend([1] * len(ids))
        self.versions.extend([-1] * len(ids) if versions is None else map(int, versions))
        self._any_version |= versions is not None

    def add_inserted(self, ids: Sequence[int]) -> None:
        self.response_ids.extend(map(int, ids))
        self.mask.extend([0] * len(ids))
        self.versions.extend([-1] * len(ids))
        if self.log_probs is not None:
            self.log_probs.extend([0.0] * len(ids))

    def output(self, stop: StopReason, num_turns: int, info: dict | None = None,
               reward_score: float | None = None, tool_rewards: Sequence[float] = (),
               turn_scores: Sequence[float] = ()) -> AgentLoopOutput:
        info = dict(info or {})
        info.setdefault("model_tokens", float(sum(self.mask)))
        info.setdefault("tool_tokens", float(len(self.mask) - sum(self.mask)))
        return AgentLoopOutput(self.prompt_ids, list(self.response_ids), list(self.mask),
                               None if self.log_probs is None else list(self.log_probs), stop, num_turns, info,
                               reward_score, list(self.versions) if self._any_version else None,
                               [float(r) for r in tool_rewards], [float(s) for s in turn_scores])


@dataclass
class AgentContext:
    """What every loop of a call shares: the engine, the chat format, the tools and the budgets."""

    engine: Any                           # `AsyncEngine`: await engine.generate(TurnRequest)
    chat: ChatFormat | None               # None: the call's loops render no messages (single_turn_agent)
    tools: ToolExecutor
    multi_turn: MultiTurnConfig
    sampling: SamplingConfig
    prompt_length: int | None             # None: no prompt budget (the call's longest prompt)
    response_length: int
    stop_ids: tuple[int, ...] = ()

    def budget(self, transcript: Transcript) -> int:
        """Tokens the next turn may sample: what is left of the response budget."""
        return self.response_length - len(transcript)


class AgentLoop(ABC):
    def __init__(self, ctx: AgentContext):
        self.ctx = ctx

    @abstractmethod
    async def run(self, sample: AgentSample) -> AgentLoopOutput:
        """Play one conversation to its end."""


_REGISTRY: dict[str, type[AgentLoop]] = {}


def register(name: str):
    """Class decorator: make a loop selectable by `agent_name` (or as the default loop)."""

    def wrap(cls: type[AgentLoop]) -> type[AgentLoop]:
        if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
            raise TypeError(f"{cls!r} is not an AgentLoop subclass")
        _REGISTRY[name] = cls
        return cls

    return wrap


def registered_loops() -> dict[str, type[AgentLoop]]:
    return dict(_REGISTRY)


def load_agent_loop_config(path: str | None) -> dict[str, type[AgentLoop]]:
    """verl's `agent_loop_config_path`: a yaml list of `{name, _target_}` (an AgentLoop class path)."""
    if path is None:
        return {}
    import yaml

    from ballast.tools import import_object

    try:
        with open(path) as f:
            entries = yaml.safe_load(f) or []
    except OSError as err:
        raise ValueError(f"agent_loop_config_path={path!r} cannot be read: {err}") from err
    if not isinstance(entries, list):
        raise ValueError(f"agent_loop_config_path={path!r} must hold a list of {{name, _target_}} entries")
    loops = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or "_target_" not in entry:
            raise ValueError(f"{path}[{i}]: each entry needs 'name' and '_target_', got {entry!r}")
        cls = import_object(entry["_target_"], f"{path}[{i}]")
        if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
            raise ValueError(f"{path}[{i}]: {entry['_target_']!r} is not an AgentLoop subclass")
        loops[entry["name"]] = cls
    return loops
