"""Partial rollouts: requests in flight survive a weight update and finish under the new weights.

With a rollout pool of its own generating ahead of the trainer, the trainer's next weights can arrive
while a generation call is still running. `ResumingCore` wraps a resumable engine core (see
`RolloutBackend.core(resumable=True)`) and, before every engine step, asks a `WeightUpdates`
source whether newer weights are waiting. If so it interrupts every unfinished request (keeping the
tokens each sampled so far), loads the weights with nothing in flight, and re-adds each request as a
continuation: its prompt plus what it sampled, with the rest of its token budget. The engine therefore
re-reads the prefix under the new weights (its prefix cache was dropped by the weight load), so every
later token is sampled by the new policy. Callers see one `TurnOutput` per request, as without
interruption, with `versions` giving the weight version that sampled each token: the rollout-
correction ratio and the staleness metrics then know every token's age.

A run with partial rollouts is not reproducible token for token: where an update lands within a
generation depends on timing (as in every peer that resumes interrupted requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .async_engine import EngineCore, TurnOutput, TurnRequest, derived_seed


class WeightUpdates(Protocol):
    """Where newer weights come from, and how they get into the engine."""

    version: int
    """The version the engine serves now."""

    def newer(self) -> object | None:
        """Weights newer than `version`, or None. Called before every engine step: must be cheap."""
        ...

    def load(self, weights: object) -> int:
        """Load `weights` into the engine (nothing is in flight); returns their version."""
        ...


@dataclass
class _Request:
    request: TurnRequest
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] | None = None
    versions: list[int] = field(default_factory=list)
    parts: int = 1
    """Engine requests this one has been so far (1 + the times it was resumed)."""


class ResumingCore:
    """An `EngineCore` whose requests are interrupted and resumed when `updates` has newer weights."""

    def __init__(self, inner: EngineCore, updates: WeightUpdates):
        self.inner, self.updates = inner, updates
        self._requests: dict[str, _Request] = {}
        self.interruptions = 0
        self.resumed_requests = 0

    def add(self, request_id: str, request: TurnRequest) -> None:
        self.inner.add(request_id, request)
        self._requests[request_id] = _Request(request, log_probs=[])

    def _part_id(self, request_id: str, state: _Request) -> str:
        return request_id if state.parts == 1 else f"{request_id}~{state.parts - 1}"

    def _request_of(self, part_id: str) -> str:
        return part_id.split("~", 1)[0]

    def step(self) -> list[tuple[str, TurnOutput]]:
        weights = self.updates.newer() if self._requests else None
        if weights is not None:
            self._switch(weights)
        done = []
        for part_id, out in self.inner.step():
            request_id = self._request_of(part_id)
            state = self._requests.pop(request_id)
            self._extend(state, out.token_ids, out.log_probs)
            lps = None if out.log_probs is None else tuple(state.log_probs)
            done.append((request_id, TurnOutput(tuple(state.tokens), lps, out.finish_reason, tuple(state.versions))))
        return done

    def _extend(self, state: _Request, tokens, log_probs) -> None:
        state.tokens.extend(int(t) for t in tokens)
        state.versions.extend([self.updates.version] * len(tokens))
        if log_probs is not None:
            state.log_probs.extend(float(x) for x in log_probs)

    def _switch(self, weights: object) -> None:
        """Interrupt everything in flight, load `weights`, resume every request from where it stopped."""
        partial = self.inner.interrupt()
        for part_id, tokens, log_probs in partial:
            self._extend(self._requests[self._request_of(part_id)], tokens, log_probs)
        self.updates.load(weights)
        self.interruptions += 1
        for request_id, state in self._requests.items():
            left = state.request.max_tokens - len(state.tokens)
            if left < 1:  # cannot happen: such a request finished in the step that sampled its last token
                raise RuntimeError(f"request {request_id} was interrupted with no token budget left")
            seed = None if state.request.seed is None else derived_seed(state.request.seed, 1_000_000 + state.parts)
            state.parts += 1
            self.resumed_requests += bool(state.tokens)
            self.inner.add(self._part_id(request_id, state),
                           TurnRequest(state.request.prompt_ids + tuple(state.tokens), left, seed))

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()

    def abort_all(self) -> None:
        self.inner.abort_all()
        self._requests.clear()

    def interrupt(self):
        raise RuntimeError("a ResumingCore is not itself interrupted: it interrupts the core it wraps")
