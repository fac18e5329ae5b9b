"""What a tool is: an OpenAI function schema plus an async `execute`, with verl's tool lifecycle.

A tool is declared in a yaml file (`tool_config_path`, see `registry.py`) by its class and an OpenAI
function schema::

    {"type": "function", "function": {"name": "calculator", "description": "...",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                    "required": ["expression"]}}}

For each call the agent loop runs `create` -> `execute(instance_id, arguments)` -> `release`, as verl's
`BaseTool` does, so stateful tools (a sandbox session, an environment) keep per-conversation state.
`execute` may return a `ToolResponse`, a plain string, or verl's `(response, reward, metrics)` tuple;
`normalize_result` turns any of them into a `ToolResponse`. A reward is not added to the sample's
reward: it reaches the score function in `extra_info["tool_rewards"]`, as in verl (docs/agent_loop.md,
"What the score function receives"). Arguments are checked against the schema
(`check_arguments`) before `execute` sees them, so a tool can trust their names and basic types.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
              "array": (list,), "object": (dict,), "null": (type(None),)}


class ToolError(Exception):
    """A tool refusing its input; the message goes back to the model as the tool's response."""


@dataclass
class ToolResponse:
    """What a tool returns: text for the model, an optional step reward, numeric metrics, and the
    kind of failure when the tool handled one itself ("timeout" or "exception"; counted as such)."""

    text: str = ""
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def check_schema(schema: Any, where: str) -> dict:
    """Validate an OpenAI function-tool schema (ValueError naming `where` and the field); returns it."""
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
        raise ValueError(f"{where}: tool_schema must be {{'type': 'function', 'function': {{...}}}}, got {schema!r}")
    fn = schema["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: tool_schema.function.name must be a non-empty string, got {name!r}")
    if not isinstance(fn.get("description", ""), str):
        raise ValueError(f"{where}: tool_schema.function.description must be a string")
    params = fn.setdefault("parameters", {"type": "object", "properties": {}, "required": []})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(f"{where}: tool_schema.function.parameters.type must be 'object', got {params!r}")
    props = params.setdefault("properties", {})
    if not isinstance(props, dict):
        raise ValueError(f"{where}: tool_schema.function.parameters.properties must be a mapping")
    for key, prop in props.items():
        kinds = prop.get("type") if isinstance(prop, dict) else None
        for kind in ([kinds] if isinstance(kinds, str) else kinds or []):
            if kind not in JSON_TYPES:
                raise ValueError(f"{where}: parameter {key!r} has unknown type {kind!r} (one of {sorted(JSON_TYPES)})")
    required = params.setdefault("required", [])
    unknown = [r for r in required if r not in props]
    if unknown:
        raise ValueError(f"{where}: required parameters {unknown} are not among the properties {sorted(props)}")
    return schema


def check_arguments(schema: dict, arguments: Any) -> str | None:
    """Why `arguments` do not fit the schema's parameters (a message for the model), or None."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    params = schema["function"]["parameters"]
    props = params.get("properties", {})
    missing = [r for r in params.get("required", []) if r not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    unknown = [k for k in arguments if k not in props]
    if unknown:
        return f"unknown argument(s) {unknown}; expected {sorted(props)}"
    for key, value in arguments.items():
        kinds = props[key].get("type") if isinstance(props[key], dict) else None
        if kinds is None:
            continue
        kinds = [kinds] if isinstance(kinds, str) else kinds
        allowed = tuple(t for k in kinds for t in JSON_TYPES[k])
        if isinstance(value, bool) and bool not in allowed:  # JSON true is not a number here
            return f"argument {key!r} must be {'/'.join(kinds)}, got boolean"
        if not isinstance(value, allowed):
            return f"argument {key!r} must be {'/'.join(kinds)}, got {type(value).__name__}"
    return None


class Tool:
    """Base class of tools. Subclasses override `execute` (and `default_schema` to ship a schema).

    `config` is the tool's `config` mapping from the yaml; `timeout_s` there overrides the agent
    loop's default time limit for one call.
    """

    default_schema: dict | None = None

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        self.config = dict(config or {})
        schema = tool_schema if tool_schema is not None else self.default_schema
        if schema is None:
            raise ValueError(f"{type(self).__name__} has no tool_schema and no default_schema")
        self.schema = check_schema(_copy(schema), type(self).__name__)
        self.name: str = self.schema["function"]["name"]
        timeout = self.config.get("timeout_s")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"tool {self.name!r}: config.timeout_s={timeout!r} must be a number > 0")
        self.timeout_s: float | None = None if timeout is None else float(timeout)

    async def create(self, instance_id: str | None = None, **kwargs) -> str:
        return instance_id or uuid.uuid4().hex

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> ToolResponse | str | tuple:
        raise NotImplementedError

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


def normalize_result(result: Any) -> ToolResponse:
    """A ToolResponse from whatever `execute` returned (ToolResponse, str, bytes or verl's tuple)."""
    if isinstance(result, tuple) and len(result) == 3:
        response, reward, metrics = result
        out = normalize_result(response)
        out.reward = None if reward is None else float(reward)
        out.metrics = {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float))}
        return out
    if isinstance(result, ToolResponse):
        return result
    if hasattr(result, "text") and not isinstance(result, (str, bytes)):  # verl's pydantic ToolResponse
        return ToolResponse(text=result.text or "")
    if isinstance(result, (str, bytes)):
        return ToolResponse(text=result)
    return ToolResponse(text=str(result))


def _copy(value):
    import copy

    return copy.deepcopy(value)
