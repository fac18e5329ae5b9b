"""Run one model-written Python program inside the OS-level sandbox and collect what it did.

    sandbox = Sandbox(SandboxLimits(timeout_s=2), owner="tool 'code_interpreter'")   # refuses if it can't isolate
    result = await sandbox.run("print(input()[::-1])", stdin=b"abc\n")
    result.stdout, result.stderr, result.exit_code, result.reason                   # b"cba\n", b"", 0, None

Every execution is a fresh bubblewrap sandbox (see `isolation.py`: namespaces, read-only minimal
filesystem, private tmpfs, uid 65534, empty environment, seccomp, a process cap). Inside it a small
runner lowers the resource limits (address space, CPU seconds, file size, open files, core dumps and,
when the trainer is not root, processes), soft and hard alike so the program cannot raise them back,
closes every inherited descriptor above stderr, and runs the program as `__main__`. The parent feeds
`stdin`, reads stdout and stderr up to `max_output_bytes` together, and ends the whole sandbox (its
PID namespace dies with its init) at `timeout_s` wall-clock seconds or when the output cap is hit.
Nothing the program does raises here: every outcome is a `SandboxResult` whose `reason` says what
stopped it (None: it exited 0).

`Sandbox(..., unsafe=True)` runs the same runner in a plain child interpreter (isolated mode, empty
environment, own session, temporary working directory, the same rlimits) for machines where the
sandbox cannot be set up; it says so loudly when built and marks every result `isolated=False`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

from ballast.tools.isolation import (PROGRAM_PATH, ExecutionCgroup, Isolation, SandboxUnavailableError,
                                     bwrap_command, probe, _memfd)

logger = logging.getLogger(__name__)

# Runs first inside the sandbox (argv: the program's path, then NAME=VALUE rlimits): limits, then the
# program. Soft = hard, so the limits stay. Only cheap imports before the program starts.
RUNNER = r'''
import os, resource, sys
def _setup():
    for item in sys.argv[2:]:  # NAME=VALUE
        name, _, value = item.partition("=")
        kind, value = getattr(resource, name), int(value)
        hard = resource.getrlimit(kind)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))
    os.closerange(3, 1 << 16)
    sys.argv = sys.argv[1:2]
    with open(sys.argv[0], "rb") as f:
        return compile(f.read(), sys.argv[0], "exec")
_code = _setup()
del _setup
try:
    exec(_code, {"__name__": "__main__", "__file__": sys.argv[0], "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as err:
    import traceback
    traceback.print_exception(type(err), err, err.__traceback__.tb_next)
    sys.stderr.flush()
    os._exit(1)
'''


@dataclass(frozen=True)
class SandboxLimits:
    """Per-execution limits. Units in the names; `from_config` reads a tool's or reward's config."""

    timeout_s: float = 5.0
    memory_bytes: int = 256 << 20
    max_processes: int = 16
    max_output_bytes: int = 64 << 10
    tmpfs_bytes: int = 16 << 20
    max_open_files: int = 64

    def __post_init__(self):
        for name in ("timeout_s", "memory_bytes", "max_processes", "max_output_bytes", "tmpfs_bytes", "max_open_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"sandbox limit {name}={value!r} must be a number > 0")

    @classmethod
    def from_config(cls, config: dict, where: str, *, timeout_key: str = "timeout_s",
                    default_timeout_s: float = 5.0) -> "SandboxLimits":
        """Keys: `timeout_key` (s), `memory_mb`, `max_processes`, `max_output_bytes`, `tmpfs_mb`."""
        def number(key, default, kind=float):
            value = config.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{where}: config.{key}={value!r} must be a number > 0")
            return kind(value)

        return cls(timeout_s=number(timeout_key, default_timeout_s), memory_bytes=number("memory_mb", 256, int) << 20,
                   max_processes=number("max_processes", 16, int),
                   max_output_bytes=number("max_output_bytes", 64 << 10, int),
                   tmpfs_bytes=number("tmpfs_mb", 16, int) << 20)


@dataclass(frozen=True)
class SandboxResult:
    stdout: bytes
    stderr: bytes
    exit_code: int | None
    reason: str | None  # None | "exit_status" | "timeout" | "output_limit" | "memory" | "cpu_time" | "killed" | "sandbox_error"
    truncated: bool
    seconds: float
    isolated: bool

    @property
    def ok(self) -> bool:
        return self.reason is None

    def text(self, stream: str = "stdout") -> str:
        return getattr(self, stream).decode("utf-8", errors="replace")


class Sandbox:
    """Runs programs in the sandbox with `limits`; built once per tool or reward (see module docstring).

    `owner` names the user in errors ("tool 'python'"). Raises SandboxUnavailableError at construction
    when the sandbox cannot be set up here, unless `unsafe`."""

    def __init__(self, limits: SandboxLimits, *, owner: str, unsafe: bool = False, bwrap_path: str | None = None):
        if not isinstance(unsafe, bool):
            raise ValueError(f"{owner}: config.unsafe={unsafe!r} must be true or false")
        self.limits, self.owner, self.unsafe = limits, owner, unsafe
        self.isolation: Isolation | None = None
        if unsafe:
            logger.warning("%s: unsafe=true: model-written code runs WITHOUT the OS-level sandbox (no namespaces, "
                           "no seccomp, the trainer's filesystem and network are reachable); resource limits only", owner)
            print(f"[ballast] WARNING: {owner} runs model-written code without isolation (unsafe: true)", file=sys.stderr)
            return
        iso = probe(bwrap_path)
        if not iso.ok:
            raise SandboxUnavailableError(
                f"{owner} runs model-written code and needs the OS-level sandbox, which cannot be set up here: "
                f"{'; '.join(iso.missing)}. Fix that (docs/reliability.md, 'Running model-written code'), or set "
                "unsafe: true in its config to run the code without isolation")
        self.isolation = iso

    async def run(self, program: str | bytes, stdin: str | bytes = b"", *, timeout_s: float | None = None) -> SandboxResult:
        """Run `program` (Python source) with `stdin`; never raises for anything the program does."""
        program = program.encode("utf-8", errors="surrogatepass") if isinstance(program, str) else program
        stdin = stdin.encode("utf-8", errors="surrogatepass") if isinstance(stdin, str) else stdin
        timeout = float(timeout_s or self.limits.timeout_s)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="ballast-sandbox-") as scratch:
            launch = _Launch(self, program, timeout, scratch)
            try:
                proc = await asyncio.create_subprocess_exec(
                    *launch.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, pass_fds=launch.pass_fds, close_fds=True, env={},
                    cwd=launch.cwd, start_new_session=True)
            except OSError as err:
                launch.close()
                return SandboxResult(b"", f"the sandbox did not start: {err}".encode(), None, "sandbox_error", False,
                                     time.perf_counter() - start, not self.unsafe)
            launch.close_child_ends()
            try:
                streams, truncated, timed_out = await _collect(proc, stdin, timeout, self.limits.max_output_bytes)
            finally:
                launch.terminate(proc)
                await _drain_and_reap(proc)
                started = launch.finish()
        return _result(streams, proc.returncode, truncated, timed_out, started, time.perf_counter() - start,
                       not self.unsafe)

    def run_sync(self, program: str | bytes, stdin: str | bytes = b"", *, timeout_s: float | None = None) -> SandboxResult:
        """`run` from plain (non-async) code, e.g. a reward function's worker thread."""
        return asyncio.run(self.run(program, stdin, timeout_s=timeout_s))

    def rlimits(self, timeout_s: float) -> list[tuple[str, int]]:
        lim = self.limits
        limits = [("RLIMIT_AS", lim.memory_bytes), ("RLIMIT_CPU", math.ceil(timeout_s) + 1),
                  ("RLIMIT_FSIZE", lim.tmpfs_bytes), ("RLIMIT_NOFILE", lim.max_open_files), ("RLIMIT_CORE", 0)]
        if self.unsafe or self.isolation.process_cap == "rlimit":
            limits.append(("RLIMIT_NPROC", lim.max_processes + 1))  # + the sandbox's init (pid 1)
        return limits


class _Launch:
    """The command line and descriptors of one execution, and ending it: kill the sandbox's init (its
    PID namespace dies with it), the launcher's process group, and every task of its cgroup."""

    def __init__(self, sandbox: Sandbox, program: bytes, timeout_s: float, scratch: str):
        self.sandbox, self.cgroup, self.info_r, self._fds, self._child_fds = sandbox, None, None, [], []
        if sandbox.unsafe:
            path = os.path.join(scratch, "main.py")
            with open(path, "wb") as f:
                f.write(program)
            self.argv = [os.path.realpath(sys.executable), "-I", "-S", "-B", "-c", RUNNER, path,
                         *_limit_args(sandbox.rlimits(timeout_s))]
            self.pass_fds, self.cwd = (), scratch
            return
        iso = sandbox.isolation
        runner_fd, program_fd, seccomp_fd = _memfd(RUNNER.encode()), _memfd(program), _memfd(iso.seccomp_bpf)
        self.info_r, info_w = os.pipe()
        os.set_blocking(self.info_r, False)
        self._fds = [self.info_r]
        self._child_fds = [runner_fd, program_fd, seccomp_fd, info_w]
        self.argv = bwrap_command(iso, tmpfs_bytes=sandbox.limits.tmpfs_bytes, runner_fd=runner_fd,
                                  program_fd=program_fd, seccomp_fd=seccomp_fd, info_fd=info_w,
                                  runner_args=[PROGRAM_PATH, *_limit_args(sandbox.rlimits(timeout_s))])
        if iso.process_cap == "cgroup":  # bwrap, its init and the program: the cap counts them all
            self.cgroup = ExecutionCgroup(iso.cgroup_root, sandbox.limits.max_processes + 2)
            self.argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', self.cgroup.procs_file, *self.argv]
        self.pass_fds, self.cwd = tuple(self._child_fds), "/"

    def close_child_ends(self) -> None:
        for fd in self._child_fds:
            os.close(fd)
        self._child_fds = []

    def close(self) -> None:
        self.close_child_ends()
        self.finish()

    def terminate(self, proc) -> None:
        if proc.returncode is None:
            init_pid = self._init_pid()
            if init_pid is not None:  # bwrap has not reaped its child yet, so the pid is still its
                _kill(init_pid)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.cgroup is not None:
            self.cgroup.kill_all()

    def _init_pid(self) -> int | None:
        if self.info_r is None:
            return None
        try:
            self._info = getattr(self, "_info", b"") + os.read(self.info_r, 4096)
        except (BlockingIOError, OSError):
            pass
        try:
            return int(json.loads(self._info.decode())["child-pid"])
        except (AttributeError, ValueError, KeyError, TypeError):
            return None

    def finish(self) -> bool:
        """Close the rest and remove the cgroup; True if the sandbox got as far as starting the program."""
        started = self.sandbox.unsafe or self._init_pid() is not None
        for fd in self._fds:
            os.close(fd)
        self._fds, self.info_r = [], None
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        return started


def _limit_args(limits: list[tuple[str, int]]) -> list[str]:
    return [f"{name}={value}" for name, value in limits]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _collect(proc, stdin: bytes, timeout_s: float, cap: int) -> tuple[dict, bool, bool]:
    """({'stdout': bytes, 'stderr': bytes}, output cut at the cap, wall-clock limit hit)."""
    chunks = {"stdout": [], "stderr": []}
    size = [0]
    full = asyncio.Event()

    async def feed():
        try:
            proc.stdin.write(stdin)
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):  # the program did not read it all
            pass
        finally:
            proc.stdin.close()

    async def read(name, stream):
        while not full.is_set():
            chunk = await stream.read(65536)
            if not chunk:
                return
            room = cap - size[0]
            chunks[name].append(chunk[:room])
            size[0] += min(len(chunk), room)
            if len(chunk) > room:
                full.set()

    tasks = [asyncio.ensure_future(feed()), asyncio.ensure_future(read("stdout", proc.stdout)),
             asyncio.ensure_future(read("stderr", proc.stderr))]
    waiter = asyncio.ensure_future(full.wait())
    exited = asyncio.ensure_future(proc.wait())
    finished = asyncio.gather(*tasks[1:], exited)
    try:
        await asyncio.wait([finished, waiter], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        timed_out = not full.is_set() and not finished.done()
    finally:
        for task in (*tasks, waiter, exited, finished):
            task.cancel()
        await asyncio.gather(*tasks, waiter, exited, finished, return_exceptions=True)
    return {k: b"".join(v) for k, v in chunks.items()}, full.is_set(), timed_out


async def _drain_and_reap(proc, limit_s: float = 5.0) -> None:
    """Read the ended sandbox's pipes to their end, then reap it. asyncio's `wait()` returns only once
    every pipe is closed, and a reader that stopped at the output cap leaves its transport paused with
    a full buffer: it would never see the end of the pipe."""
    async def finish():
        if not proc.stdin.is_closing():
            proc.stdin.close()
        for stream in (proc.stdout, proc.stderr):
            while await stream.read(1 << 16):
                pass
        await proc.wait()

    try:
        await asyncio.wait_for(finish(), limit_s)
    except asyncio.TimeoutError:  # something else holds a pipe open: the kill already went out
        pass


def _result(streams: dict, code: int | None, truncated: bool, timed_out: bool, started: bool, seconds: float,
            isolated: bool) -> SandboxResult:
    stdout, stderr = streams["stdout"], streams["stderr"]
    if timed_out:
        reason = "timeout"
    elif truncated:
        reason = "output_limit"
    elif not started:
        reason = "sandbox_error"
    elif code == 0:
        reason = None
    elif code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        reason = "cpu_time"
    elif b"MemoryError" in stderr[-4096:]:
        reason = "memory"
    elif code is not None and (code < 0 or code > 128):
        reason = "killed"
    else:
        reason = "exit_status"
    return SandboxResult(stdout, stderr, code, reason, truncated, seconds, isolated)


__all__ = ["RUNNER", "Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailableError"]
