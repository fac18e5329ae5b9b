"""Loading tools from verl's `tool_config_path` yaml.

    tools:
      - class_name: ballast.tools.calculator.CalculatorTool   # any importable Tool subclass
        config: {type: native, timeout_s: 5}                  # handed to the tool; type must be native
        tool_schema:                                          # optional when the class ships one
          type: function
          function: {name: calculator, description: ..., parameters: {...}}

Short names for the shipped tools: `calculator`, `python` and `code_interpreter`. Every problem (unreadable file, missing
class, bad schema, two tools with one name) is a ValueError naming the file and the entry.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ballast.tools.base import Tool

BUILTIN_TOOLS = {
    "calculator": "ballast.tools.calculator.CalculatorTool",
    "python": "ballast.tools.python_expr.PythonExpressionTool",
    "code_interpreter": "ballast.tools.code_interpreter.CodeInterpreterTool",
}


def import_object(dotted: str, what: str):
    """`module.attr` -> the object; ValueError naming `what` when it cannot be imported."""
    module_name, _, attr = dotted.rpartition(".")
    if not module_name:
        raise ValueError(f"{what}: {dotted!r} is not a dotted path module.Name")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise ValueError(f"{what}: cannot import module {module_name!r}: {err}") from err
    if not hasattr(module, attr):
        raise ValueError(f"{what}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def load_tools(path: str | None) -> dict[str, Tool]:
    """The tools declared in the yaml at `path`, by name (empty for None)."""
    if path is None:
        return {}
    import yaml

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"tool_config_path={str(path)!r} is not a file")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"tool_config_path={str(path)!r} is not valid yaml: {err}") from err
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"tool_config_path={str(path)!r} must hold a top-level 'tools:' list")
    tools: dict[str, Tool] = {}
    for i, entry in enumerate(entries):
        tool = build_tool(entry, f"{path} tools[{i}]")
        if tool.name in tools:
            raise ValueError(f"{path} tools[{i}]: a second tool named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def build_tool(entry, where: str) -> Tool:
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ValueError(f"{where}: each tool needs a 'class_name' string, got {entry!r}")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"{where}: 'config' must be a mapping, got {config!r}")
    kind = config.get("type", "native")
    if kind != "native":
        raise ValueError(f"{where}: config.type={kind!r} is not supported (only 'native' tools)")
    cls = import_object(BUILTIN_TOOLS.get(entry["class_name"], entry["class_name"]), where)
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"{where}: {entry['class_name']!r} is not a ballast.tools.Tool subclass")
    try:
        return cls(config={k: v for k, v in config.items() if k != "type"}, tool_schema=entry.get("tool_schema"))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err
    except Exception as err:  # the tool's own failure: named with its file and entry, not a bare traceback
        raise ValueError(f"{where}: {entry['class_name']} raised {type(err).__name__} while starting: {err}") from err
