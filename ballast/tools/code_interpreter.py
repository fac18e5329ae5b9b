"""A code-interpreter tool (the shape of verl's sandbox tool): the model sends a whole Python program,
it runs inside the OS-level sandbox, and the model reads back its stdout, its stderr and how it ended.

    {"name": "code_interpreter", "arguments": {"code": "import math\\nprint(math.factorial(20))"}}
    -> "2432902008176640000\\n"

The response is stdout, then stderr, then one line when the program did not end cleanly
("exit status 1", "TimeoutError: the program ran longer than 5 s", "MemoryError: ...", "the output
was cut at 65536 bytes"). The executor then cuts it to `max_tool_response_length` characters on
`tool_response_truncate_side`, as for every tool. A program that fails is an ordinary answer (its
traceback is what the model needs); it is counted as the call's "exception" ("timeout" for a timeout).

Config keys: `timeout_s` (5; verl's `default_timeout` is read too), `memory_mb` (256; verl's
`memory_limit_mb` too), `max_output_bytes` (65536), `max_processes` (16), `tmpfs_mb` (16), `max_code_chars`
(20000), `unsafe` (false), `bwrap_path` (optional); see `ballast.tools.sandbox`. Unlike verl's tool it runs
Python only (`default_language` other than python is refused) and locally, not through a SandboxFusion
service (`sandbox_fusion_url` is refused rather than ignored).
"""

from __future__ import annotations

from ballast.tools.base import Tool, ToolError, ToolResponse
from ballast.tools.sandbox import Sandbox, SandboxLimits, SandboxResult

ENDINGS = {
    "timeout": "TimeoutError: the program ran longer than {timeout:g} s",
    "memory": "MemoryError: the program needed more than {memory_mb} MiB",
    "cpu_time": "the program used up its CPU time",
    "killed": "the program was killed (exit status {code})",
    "exit_status": "exit status {code}",
    "output_limit": "the output was cut at {cap} bytes",
    "sandbox_error": "the sandbox could not start the program",
}


def describe_run(result: SandboxResult, limits: SandboxLimits) -> str:
    """stdout, stderr and a closing line saying how the program ended (nothing when it exited 0)."""
    parts = [result.text("stdout"), result.text("stderr")]
    if result.reason is not None:
        parts.append(ENDINGS[result.reason].format(timeout=limits.timeout_s, memory_mb=limits.memory_bytes >> 20,
                                                   code=result.exit_code, cap=limits.max_output_bytes))
    text = "\n".join(p.rstrip("\n") for p in parts if p)
    return text + "\n" if text and result.reason is None else text or "(no output)"


class CodeInterpreterTool(Tool):
    default_schema = {
        "type": "function",
        "function": {
            "name": "code_interpreter",
            "description": "Run a Python 3 program (standard library only, no network, no files outside /tmp) "
                           "and return what it printed. Use print() for anything you want to see.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the complete Python program"}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        where = f"tool {self.name!r}"
        cfg = dict(self.config)
        if "default_timeout" in cfg:  # verl's name for the run's time limit
            cfg.setdefault("timeout_s", cfg["default_timeout"])
        if "memory_limit_mb" in cfg:  # verl's name for the memory limit
            cfg.setdefault("memory_mb", cfg["memory_limit_mb"])
        if cfg.get("default_language", "python") != "python":
            raise ValueError(f"{where}: config.default_language={cfg['default_language']!r}: only python programs run here")
        if "sandbox_fusion_url" in cfg:
            raise ValueError(f"{where}: config.sandbox_fusion_url is verl's remote sandbox service; this tool runs "
                             "programs locally in Ballast's OS-level sandbox: remove the key")
        self.limits = SandboxLimits.from_config(cfg, where)
        self.max_code_chars = int(cfg.get("max_code_chars", 20000))
        self.sandbox = Sandbox(self.limits, owner=where, unsafe=cfg.get("unsafe", False),
                               bwrap_path=cfg.get("bwrap_path"))
        # The executor's limit must leave the sandbox time to end the program and report it.
        self.timeout_s = max(self.timeout_s or 0.0, self.limits.timeout_s + 2.0)

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> ToolResponse:
        code = parameters["code"]
        if len(code) > self.max_code_chars:
            raise ToolError(f"the program has {len(code)} characters; at most {self.max_code_chars} are allowed")
        result = await self.sandbox.run(code)
        error = "timeout" if result.reason == "timeout" else "exception" if result.reason else None
        return ToolResponse(text=describe_run(result, self.limits), error=error,
                            metrics={"sandbox_seconds": result.seconds, "sandbox_unsafe": float(not result.isolated)})
