"""A Python-expression tool: the model's expression evaluated inside the OS-level sandbox.

The sandbox (`sandbox.py`) is the boundary. Inside it, as a second layer, the expression is evaluated
with a few builtins and the `math` module only, after an AST check that refuses names and attributes
starting with `_`, the frame/code/traceback attributes of generators, coroutines and frames (`gi_frame`,
`f_globals`, `tb_frame`, `co_code`, ...) that lead from any object to a module's globals, and
`format`/`format_map`, whose format strings read attributes that the AST never shows ("{0.__class__}").

Config keys: `timeout_s` (5, wall-clock seconds of one evaluation), `memory_mb` (256), `max_output_bytes`
(65536), `max_processes` (16), `tmpfs_mb` (16), `unsafe` (false: refuse to start where the sandbox cannot
be set up; true: run without it, loudly), `bwrap_path` (optional). A timeout, a memory error or an
exception inside the expression goes back to the model as text ("TimeoutError: ...", "MemoryError: ...",
"ZeroDivisionError: ...") with the call's error kind ("timeout" or "exception").
"""

from __future__ import annotations

from ballast.tools.base import Tool, ToolError, ToolResponse
from ballast.tools.sandbox import Sandbox, SandboxLimits

MAX_EXPRESSION_CHARS = 4000

# The evaluator, run as the sandboxed program; the expression arrives on stdin. Output: one status
# byte, R (the repr follows) or E (the error follows).
EVALUATOR = r'''
import ast, math, sys
SAFE = ("abs all any bin bool chr dict divmod enumerate filter float hex int len list map max min oct ord pow "
        "range repr reversed round set sorted str sum tuple zip True False None").split()
INTROSPECTION = ("gi_", "cr_", "ag_", "f_", "tb_", "co_")
FORMATTING = ("format", "format_map")
import builtins
env = {"__builtins__": {k: getattr(builtins, k) for k in SAFE if hasattr(builtins, k)}, "math": math}
def check(tree):
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name is None:
            continue
        if name.startswith("_"):
            raise ValueError("names and attributes starting with '_' are not allowed")
        if isinstance(node, ast.Attribute) and (name.startswith(INTROSPECTION) or name in FORMATTING):
            raise ValueError(f"the attribute {name!r} is not allowed")
try:
    tree = ast.parse(sys.stdin.read(), mode="eval")
    check(tree)
    result = eval(compile(tree, "<expression>", "eval"), env)
    sys.stdout.write("R" + repr(result))
except MemoryError:
    sys.stdout.write("EMemoryError: the expression needs more memory than allowed")
except BaseException as err:
    sys.stdout.write(f"E{type(err).__name__}: {err}")
'''


class PythonExpressionTool(Tool):
    default_schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Evaluate one Python expression (math module available) and return its value.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "a Python expression"}},
                "required": ["expression"],
            },
        },
    }

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        where = f"tool {self.name!r}"
        # The sandbox's own wall-clock limit; the executor's limit (config timeout_s) is a backstop.
        timeout_key = "sandbox_timeout_s" if "sandbox_timeout_s" in self.config else "timeout_s"
        self.limits = SandboxLimits.from_config(self.config, where, timeout_key=timeout_key)
        self.sandbox = Sandbox(self.limits, owner=where, unsafe=self.config.get("unsafe", False),
                               bwrap_path=self.config.get("bwrap_path"))
        if self.timeout_s is not None:  # leave the sandbox time to report its own timeout
            self.timeout_s = max(self.timeout_s, self.limits.timeout_s + 2.0)

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> ToolResponse:
        expression = parameters["expression"]
        if len(expression) > MAX_EXPRESSION_CHARS:
            raise ToolError(f"the expression has {len(expression)} characters; at most {MAX_EXPRESSION_CHARS} "
                            "are allowed")
        result = await self.sandbox.run(EVALUATOR, expression)
        metrics = {"sandbox_seconds": result.seconds, "sandbox_unsafe": float(not result.isolated)}
        if result.reason == "timeout":
            return ToolResponse(text=f"TimeoutError: the expression ran longer than {self.limits.timeout_s:g} s",
                                error="timeout", metrics=metrics)
        out = result.stdout
        body = out[1:] if out[:1] in (b"R", b"E") else out
        text = body.decode("utf-8", errors="replace")
        if result.truncated:
            text += "...(output cut)"
        if not out:
            text = f"Error: the sandbox ended without output ({result.reason}, exit code {result.exit_code})"
        failed = not out.startswith(b"R") or result.reason not in (None, "output_limit")
        return ToolResponse(text=text, error="exception" if failed else None, metrics=metrics)
