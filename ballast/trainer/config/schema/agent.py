"""Schema of `actor_rollout_ref.rollout.multi_turn` and `.agent`: agent loops and tools (every rollout runs agent loops)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class MultiTurnSection:
    enable: bool
    """Tool-calling conversations. As in verl, a row runs the tool loop when its
    `agent_name` (or `agent.default_agent_loop`) is `tool_agent`; with `default_agent_loop=null` this
    switch makes `tool_agent` the default."""
    max_assistant_turns: Optional[int]
    """A conversation ends after this many model turns; null: only the response budget ends it."""
    max_user_turns: Optional[int]
    """A conversation ends after this many tool-response turns; null: no limit."""
    tool_config_path: Optional[str]
    """verl's tool yaml (`tools:` list of class_name, config, tool_schema); null: no tools."""
    max_parallel_calls: int
    """Tool calls run per model turn (concurrently); later calls in the same turn are dropped."""
    max_tool_response_length: int
    """Characters of one tool response kept (verl's unit)."""
    tool_response_truncate_side: str
    """Where a long tool response is cut: `left` (keep the end), `right` (keep the start) or `middle`."""
    tokenization_sanity_check_mode: str
    """Compare each conversation's token sequence with the chat template's rendering: `strict` (any
    difference is flagged, and a template that fails a synthetic tool conversation stops the run at
    start-up), `ignore_strippable` (whitespace differences pass) or `disable`."""
    format: str
    """Tool-call format the model writes: `hermes` (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`)."""
    tool_timeout_s: float
    """Time limit of one tool call in seconds, for tools whose config sets no `timeout_s` (Ballast's key)."""


@dataclass(frozen=True)
class AgentSection:
    default_agent_loop: Optional[str]
    """Loop of samples without an `agent_name` column: `single_turn_agent` (verl's default, whatever
    `multi_turn.enable` says), `tool_agent` or a name from `agent_loop_config_path`; null (Ballast's):
    `tool_agent` when multi_turn.enable, else `single_turn_agent`."""
    agent_loop_config_path: Optional[str]
    """verl's yaml list of extra agent loops (`- name: ...` / `_target_: module.Class`)."""
    num_workers: int
    """Accepted for verl compatibility, no effect: Ballast runs the agent loops inside each rollout worker."""
    max_concurrent_conversations: Optional[int]
    """Conversations in flight per rollout worker; null: all of its rows (Ballast's key)."""
