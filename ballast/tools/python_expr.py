"""A Python-expression tool: the model's expression evaluated in the subprocess sandbox.

Config keys: `timeout_s` (5), `memory_mb` (256), `max_output_bytes` (65536). A timeout, a memory
error or an exception inside the expression is reported to the model as text ("TimeoutError: ...",
"MemoryError: ...", "ZeroDivisionError: ...") and recorded as the call's error kind ("timeout" or
"exception"); only a sandbox that cannot start raises.
"""

from __future__ import annotations

from ballast.tools.base import Tool, ToolError, ToolResponse
from ballast.tools.sandbox import run_expression


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
        # The sandbox's own wall-clock limit; the executor's limit (config timeout_s) is a backstop.
        self.sandbox_timeout_s = float(self.config.get("sandbox_timeout_s", self.config.get("timeout_s", 5.0)))
        self.memory_bytes = int(self.config.get("memory_mb", 256)) << 20
        self.max_output_bytes = int(self.config.get("max_output_bytes", 64 << 10))
        if self.timeout_s is not None:  # leave the sandbox time to report its own timeout
            self.timeout_s = max(self.timeout_s, self.sandbox_timeout_s + 2.0)

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> ToolResponse:
        expression = parameters["expression"]
        if len(expression) > 4000:
            raise ToolError(f"the expression has {len(expression)} characters; at most 4000 are allowed")
        result = await run_expression(expression, timeout_s=self.sandbox_timeout_s, memory_bytes=self.memory_bytes,
                                      max_output_bytes=self.max_output_bytes)
        if result.timed_out:
            return ToolResponse(text=f"TimeoutError: the expression ran longer than {self.sandbox_timeout_s:g} s",
                                error="timeout")
        text = result.text
        if result.truncated:
            text += "...(output cut)"
        if not result.output:
            text = f"Error: the sandbox exited with code {result.exit_code} without output"
        return ToolResponse(text=text, error="exception" if result.failed else None,
                            metrics={"sandbox_seconds": result.seconds})
