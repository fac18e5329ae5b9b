"""Running tool calls for an agent loop: a time limit per call, bounded parallelism, clean output.

A tool is foreign code: it may raise, hang, block the event loop, print megabytes or return bytes
that are not UTF-8. None of that may stall a rollout step, so every call

  * runs on its own daemon thread with its own event loop, and the agent loop waits for it at most
    `timeout_s` (the tool's `config.timeout_s`, else the executor's default). A call that does not
    return in time is recorded as a timeout; its coroutine is cancelled in its own loop (an
    awaiting tool ends there and is released), but Python cannot stop a thread, so a tool blocked
    in plain Python keeps its thread until it returns (sandboxed tools kill their own subprocess at
    their own deadline, see `sandbox.py`);
  * holds one of `max_concurrency` slots (all conversations of a worker together), and a turn runs at
    most `max_parallel_calls` of its calls (verl: calls beyond that are dropped, and counted here);
  * returns text that is valid UTF-8 (bytes are decoded with replacement characters, lone surrogates
    replaced), cut to `max_output_chars` on arrival and then to `max_response_length` characters on
    the `truncate_side` ("left" keeps the end, "right" the start, "middle" both ends), as verl.
Every failure becomes the tool's response text plus a recorded `error` kind, so the conversation
goes on and the step's metrics can count it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Literal

from ballast.tools.base import Tool, ToolError, check_arguments, normalize_result

TruncateSide = Literal["left", "right", "middle"]
TRUNCATE_SIDES = ("left", "right", "middle")
ErrorKind = Literal["unknown_tool", "invalid_arguments", "exception", "timeout", "malformed_call"]


@dataclass(frozen=True)
class ToolCall:
    """A call parsed from the model's text. `error` set: the call could not be parsed (`name` may be
    empty); the executor answers it with the error instead of running anything."""

    name: str
    arguments: object = None
    error: str | None = None


@dataclass
class ToolCallResult:
    name: str
    text: str
    error: ErrorKind | None = None
    latency_s: float = 0.0
    reward: float | None = None


def clean_text(value, max_chars: int) -> str:
    """Valid UTF-8 text of at most `max_chars` characters from a tool's str/bytes output."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value[: 4 * max_chars]).decode("utf-8", errors="replace")
    elif not isinstance(value, str):
        value = str(value)
    value = value[:max_chars]
    # Lone surrogates (e.g. bytes smuggled in by surrogateescape) cannot be encoded, so no tokenizer
    # could take them: they become replacement characters, like undecodable bytes.
    return value.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")


def truncate(text: str, max_length: int, side: TruncateSide) -> str:
    """verl's rule: at most `max_length` characters of the output, plus a marker saying it was cut."""
    if len(text) <= max_length:
        return text
    if side == "left":
        return "(truncated)..." + text[-max_length:]
    if side == "right":
        return text[:max_length] + "...(truncated)"
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:] if half else "...(truncated)..."


class ToolExecutor:
    def __init__(self, tools: dict[str, Tool], *, max_parallel_calls: int = 1, max_response_length: int = 256,
                 truncate_side: TruncateSide = "middle", timeout_s: float = 30.0, max_concurrency: int = 64,
                 max_output_chars: int = 1 << 20):
        if max_parallel_calls < 1 or max_response_length < 1 or max_concurrency < 1 or timeout_s <= 0:
            raise ValueError("max_parallel_calls, max_response_length, max_concurrency and timeout_s must be > 0")
        if truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"tool_response_truncate_side={truncate_side!r} must be one of {TRUNCATE_SIDES}")
        self.tools = dict(tools)
        self.max_parallel_calls, self.max_response_length = max_parallel_calls, max_response_length
        self.truncate_side, self.timeout_s, self.max_output_chars = truncate_side, timeout_s, max_output_chars
        self.max_concurrency = max_concurrency
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop = None

    def schemas(self, names=None) -> list[dict]:
        return [t.schema for n, t in self.tools.items() if names is None or n in names]

    async def run_turn(self, calls: list[ToolCall], tools_kwargs: dict | None = None) -> list[ToolCallResult]:
        """Run the first `max_parallel_calls` calls of one turn concurrently, results in call order."""
        calls = calls[: self.max_parallel_calls]
        return list(await asyncio.gather(*(self.run_call(c, tools_kwargs or {}) for c in calls)))

    async def run_call(self, call: ToolCall, tools_kwargs: dict) -> ToolCallResult:
        if call.error is not None:
            return ToolCallResult(call.name, f"Error: could not parse the tool call: {call.error}", "malformed_call")
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolCallResult(call.name, f"Error: unknown tool {call.name!r}; available tools: "
                                             f"{sorted(self.tools)}", "unknown_tool")
        problem = check_arguments(tool.schema, call.arguments)
        if problem is not None:
            return ToolCallResult(call.name, f"Error: invalid arguments for {call.name!r}: {problem}",
                                  "invalid_arguments")
        timeout = tool.timeout_s or self.timeout_s
        async with self._semaphore():
            start = time.perf_counter()
            future = _start_on_thread(tool, dict(call.arguments), tools_kwargs.get(call.name) or {})
            try:
                response = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
            except asyncio.TimeoutError:
                return ToolCallResult(call.name, f"Error: tool {call.name!r} did not answer within {timeout:g} s",
                                      "timeout", time.perf_counter() - start)
            except ToolError as err:
                return ToolCallResult(call.name, f"Error: {clean_text(str(err), 2000)}", "exception",
                                      time.perf_counter() - start)
            except Exception as err:  # foreign code: any exception becomes the response
                text = clean_text(f"{type(err).__name__}: {err}", 2000)
                return ToolCallResult(call.name, f"Error: tool {call.name!r} failed: {text}", "exception",
                                      time.perf_counter() - start)
            latency = time.perf_counter() - start
        text = truncate(clean_text(response.text, self.max_output_chars), self.max_response_length, self.truncate_side)
        error = response.error if response.error in ("timeout", "exception") else None
        return ToolCallResult(call.name, text, error, latency, response.reward)

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # one per event loop (one loop per call)
            self._slots, self._slots_loop = asyncio.Semaphore(self.max_concurrency), loop
        return self._slots


def _start_on_thread(tool: Tool, arguments: dict, kwargs: dict):
    """Run create/execute/release of one call on a fresh daemon thread with its own event loop, so a
    tool that blocks (or never returns) cannot stall the agent loops' event loop. Cancelling the
    returned future (a timeout does) cancels the call's coroutine in that loop, so a tool waiting
    asynchronously ends at once (its release runs); one blocking in plain Python keeps its thread."""
    import concurrent.futures

    future: concurrent.futures.Future = concurrent.futures.Future()

    async def lifecycle():
        instance = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
        try:
            return normalize_result(await tool.execute(instance, arguments, **kwargs.get("execute_kwargs", {})))
        finally:
            await tool.release(instance)

    def work():
        loop = asyncio.new_event_loop()
        task = loop.create_task(lifecycle())
        future.add_done_callback(lambda f: f.cancelled() and loop.call_soon_threadsafe(task.cancel))
        try:
            result, err = loop.run_until_complete(task), None
        except BaseException as exc:  # handed to the waiting agent loop (or dropped after a timeout)
            result, err = None, exc
        finally:
            loop.close()
        try:
            future.set_exception(err) if err is not None else future.set_result(result)
        except concurrent.futures.InvalidStateError:  # the caller gave up (timeout) and cancelled it
            pass

    threading.Thread(target=work, name=f"ballast-tool-{tool.name}", daemon=True).start()
    return future
