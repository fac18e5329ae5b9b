"""Tools for multi-turn agent loops: the tool interface, the executor that runs calls safely, the
shipped tools (a calculator, a Python-expression evaluator and a code interpreter, the last two inside
the OS-level sandbox of `sandbox.py`/`isolation.py`) and the yaml loader.

    tools = load_tools("tools.yaml")                     # verl's tool_config_path format
    executor = ToolExecutor(tools, max_parallel_calls=2, max_response_length=256, timeout_s=10)
    results = await executor.run_turn([ToolCall("calculator", {"expression": "12*34"})])

Nothing here imports torch or Ray: tools run inside rollout workers but know nothing about them.
"""

from ballast.tools.base import Tool, ToolError, ToolResponse, check_arguments, check_schema, normalize_result
from ballast.tools.calculator import CalculatorTool
from ballast.tools.code_interpreter import CodeInterpreterTool
from ballast.tools.executor import ToolCall, ToolCallResult, ToolExecutor, clean_text, truncate
from ballast.tools.python_expr import PythonExpressionTool
from ballast.tools.registry import BUILTIN_TOOLS, build_tool, import_object, load_tools
from ballast.tools.sandbox import Sandbox, SandboxLimits, SandboxResult, SandboxUnavailableError

__all__ = [
    "BUILTIN_TOOLS", "CalculatorTool", "CodeInterpreterTool", "PythonExpressionTool", "Sandbox", "SandboxLimits",
    "SandboxResult", "SandboxUnavailableError", "Tool", "ToolCall", "ToolCallResult", "ToolError", "ToolExecutor",
    "ToolResponse", "build_tool", "check_arguments", "check_schema", "clean_text", "import_object", "load_tools",
    "normalize_result", "truncate",
]
