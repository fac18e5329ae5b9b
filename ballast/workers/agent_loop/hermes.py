"""Tool calls in verl's `hermes` format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

`parse_hermes(text)` returns the text without the call blocks and one `ToolCall` per block. A block
whose JSON does not parse, is not an object, lacks a string "name" or has arguments that are neither
an object nor a JSON string of one becomes a call with `error` set (the executor answers it with the
error, the conversation goes on, and it is counted); so does an opening tag that is never closed.
"""

from __future__ import annotations

import json
import re

from ballast.tools import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
FORMATS = ("hermes",)


def parse_call(body: str) -> ToolCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall("", None, f"invalid JSON ({err.msg} at position {err.pos})")
    if not isinstance(payload, dict):
        return ToolCall("", None, f"expected a JSON object with 'name' and 'arguments', got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", None, "the call has no 'name' string")
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(name, None, "'arguments' is a string that is not JSON")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, f"'arguments' must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, arguments)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """(text without the call blocks, the calls in order)."""
    calls = [parse_call(body.strip()) for body in _BLOCK.findall(text)]
    rest = _BLOCK.sub("", text)
    if OPEN in rest:
        calls.append(ToolCall("", None, f"{OPEN} without a closing {CLOSE}"))
    return rest, calls
