"""What the agent loops of a rollout worker are built from: frozen, checked once, keys as verl's.

`MultiTurnConfig` mirrors `actor_rollout_ref.rollout.multi_turn` and `AgentLoopSpec` the rest of what a
worker needs (`actor_rollout_ref.rollout.agent`, the tokenizer, the length budgets). An invalid value
raises `SpecError` naming the field, which the trainer reports with the config key it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ballast.engine.config import SpecError
from ballast.tools.executor import TRUNCATE_SIDES
from ballast.workers.agent_loop.chat import SANITY_MODES
from ballast.workers.agent_loop.hermes import FORMATS


def _positive_int_or_none(key: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SpecError(key, f"{key}={value!r} must be null or an int >= 1")


@dataclass(frozen=True)
class MultiTurnConfig:
    """Tool-calling conversations (verl's `rollout.multi_turn`).

    max_assistant_turns / max_user_turns: a conversation ends after that many model turns / tool
    response turns (None: no limit but the response budget). max_parallel_calls: calls run per turn
    (later ones are dropped). max_tool_response_length: characters of one tool response kept, cut on
    `tool_response_truncate_side`. tool_timeout_s: time limit of one call for tools that set none.
    """

    enable: bool = False
    max_assistant_turns: Optional[int] = None
    max_user_turns: Optional[int] = None
    tool_config_path: Optional[str] = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tokenization_sanity_check_mode: str = "strict"
    format: str = "hermes"
    tool_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _positive_int_or_none("max_assistant_turns", self.max_assistant_turns)
        _positive_int_or_none("max_user_turns", self.max_user_turns)
        for key in ("max_parallel_calls", "max_tool_response_length"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(key, f"{key}={value!r} must be an int >= 1")
        choices = (("tool_response_truncate_side", TRUNCATE_SIDES), ("tokenization_sanity_check_mode", SANITY_MODES),
                   ("format", FORMATS))
        for key, allowed in choices:
            if getattr(self, key) not in allowed:
                raise SpecError(key, f"{key}={getattr(self, key)!r} must be one of {list(allowed)}")
        if isinstance(self.tool_timeout_s, bool) or not float(self.tool_timeout_s) > 0:
            raise SpecError("tool_timeout_s", f"tool_timeout_s={self.tool_timeout_s!r} must be > 0")


@dataclass(frozen=True)
class AgentLoopSpec:
    """Everything a rollout worker's agent loops need (every rollout call runs them).

    default_agent_loop: the loop of samples without an `agent_name` ("single_turn_agent", the batched
    rollout, or "tool_agent", or a name from `agent_loop_config_path`, a yaml list of `{name, _target_}`
    entries naming `AgentLoop` subclasses). tokenizer_path: the tokenizer and chat template of loops that
    render messages (None: only loops that need neither, such as single_turn_agent). prompt_length: the
    prompt budget in tokens (None: the longest prompt of the call); a conversation's inserted and sampled
    tokens stay within the call's `max_response_length`. max_concurrent_conversations: conversations in
    flight per worker (None: all of the call's).
    """

    tokenizer_path: Optional[str] = None
    prompt_length: Optional[int] = None
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    default_agent_loop: str = "single_turn_agent"
    agent_loop_config_path: Optional[str] = None
    chat_template_kwargs: dict = field(default_factory=dict)
    max_concurrent_conversations: Optional[int] = None

    def __post_init__(self) -> None:
        _positive_int_or_none("prompt_length", self.prompt_length)
        _positive_int_or_none("max_concurrent_conversations", self.max_concurrent_conversations)
        if not isinstance(self.default_agent_loop, str) or not self.default_agent_loop:
            raise SpecError("default_agent_loop", f"default_agent_loop={self.default_agent_loop!r} must be a name")
