"""Evaluate a Python expression in a child process with a time limit, a memory limit and no files.

The child is a fresh interpreter in isolated mode (`python -I -S`: no site-packages, no user paths,
environment ignored) started in an empty temporary directory with an empty environment. Before it
reads the expression it lowers its own resource limits: address space (`memory_bytes`), CPU seconds
(`timeout_s` + 1), no file writes (RLIMIT_FSIZE 0), no core dumps, few file descriptors. The parent
reads at most `max_output_bytes` of its output and kills the child's whole process group at
`timeout_s` wall-clock seconds, so a child that loops, sleeps, allocates or prints without end costs
at most that long.

The child's output starts with one status byte, `R` (the repr of the value follows) or `E` (the
error follows); `SandboxResult.failed` and `.text` read it. The expression is evaluated with a small set of builtins and the `math` module; names and attributes
starting with an underscore are refused before evaluation, which closes the usual
`().__class__.__subclasses__()` escapes. This is resource isolation for model-written code, not a
security boundary against a determined attacker (no seccomp, namespaces or network isolation).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

# Runs in the child. Limits first, then read the request from stdin, then evaluate.
_CHILD = r"""
import ast, json, math, resource, sys
req = json.loads(sys.stdin.readline())
for limit, value in ((resource.RLIMIT_AS, req["memory_bytes"]), (resource.RLIMIT_CPU, req["cpu_s"]),
                     (resource.RLIMIT_FSIZE, 0), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 16)):
    soft, hard = resource.getrlimit(limit)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(limit, (value, hard))
SAFE = ("abs all any bin bool chr dict divmod enumerate filter float hex int len list map max min oct ord pow "
        "range repr reversed round set sorted str sum tuple zip True False None").split()
import builtins
env = {"__builtins__": {k: getattr(builtins, k) for k in SAFE if hasattr(builtins, k)}, "math": math}
try:
    tree = ast.parse(req["expression"], mode="eval")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") or \
           isinstance(node, ast.Name) and node.id.startswith("_"):
            raise ValueError("names and attributes starting with '_' are not allowed")
    result = eval(compile(tree, "<expression>", "eval"), env)
    sys.stdout.write("R" + repr(result))
except MemoryError:
    sys.stdout.write("EMemoryError: the expression needs more memory than allowed")
except BaseException as err:
    sys.stdout.write(f"E{type(err).__name__}: {err}")
"""


@dataclass(frozen=True)
class SandboxResult:
    output: bytes
    exit_code: int | None
    timed_out: bool
    truncated: bool
    seconds: float

    @property
    def failed(self) -> bool:
        """The expression raised, ran out of time or memory, or the child died."""
        return self.timed_out or not self.output.startswith(b"R")

    @property
    def text(self) -> str:
        """The value's repr or the error, as UTF-8 text (invalid bytes replaced)."""
        body = self.output[1:] if self.output[:1] in (b"R", b"E") else self.output
        return body.decode("utf-8", errors="replace")


async def run_expression(expression: str, *, timeout_s: float = 5.0, memory_bytes: int = 256 << 20,
                         max_output_bytes: int = 64 << 10) -> SandboxResult:
    """Evaluate `expression` in a limited child process; its stdout (result repr or error), capped."""
    request = json.dumps({"expression": expression, "memory_bytes": int(memory_bytes),
                          "cpu_s": int(timeout_s) + 1}) + "\n"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ballast-sandbox-") as workdir:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", "-c", _CHILD, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}, start_new_session=True,
        )
        try:
            output, truncated, timed_out = await _collect(proc, request.encode(), timeout_s, max_output_bytes)
        finally:
            _kill_group(proc)
            await _drain_and_reap(proc)
    return SandboxResult(output, proc.returncode, timed_out, truncated, time.perf_counter() - start)


async def _collect(proc, request: bytes, timeout_s: float, cap: int) -> tuple[bytes, bool, bool]:
    chunks, size = [], 0
    deadline = time.monotonic() + timeout_s
    try:
        proc.stdin.write(request)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):  # the child died before reading
        pass
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), False, True
        try:
            chunk = await asyncio.wait_for(proc.stdout.read(65536), left)
        except asyncio.TimeoutError:
            return b"".join(chunks), False, True
        if not chunk:
            return b"".join(chunks), False, False
        chunks.append(chunk[: cap - size])
        size += len(chunks[-1])
        if size >= cap:
            return b"".join(chunks), True, False


async def _drain_and_reap(proc, limit_s: float = 5.0) -> None:
    """Close its stdin, read the killed child's stdout to its end, then reap it. asyncio's `wait()`
    returns only once every pipe is closed too, and a reader that stopped at the output cap leaves
    the transport paused with a full buffer: it would never see the end of the pipe, and `wait()`
    would never return."""
    async def finish():
        proc.stdin.close()  # closing twice is harmless; a child that died before reading left it open
        while await proc.stdout.read(1 << 16):
            pass
        await proc.wait()

    try:
        await asyncio.wait_for(finish(), limit_s)
    except asyncio.TimeoutError:  # something else holds the pipe open: leave it to the kill
        pass


def _kill_group(proc) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
