"""Deliberate failures of a rollout worker at a named generate call, to rehearse rollout recovery.

`BALLAST_ROLLOUT_FAULT=<kind>@<call_index>[:<rank>]` in the driver's environment (Ray's processes get
every `BALLAST_*` setting) makes the rollout worker of that rank (default 0) fail when it starts the
training generation whose call index is `<call_index>` (the step, for the first generation of a step):

- `kill`: the process ends at once with SIGKILL (a crash, the OOM killer);
- `hang`: the process stops itself with SIGSTOP and never answers (a wedged engine or driver);
- `raise`: the engine raises `RolloutEngineError` (an engine that died inside a living process).

Only the first generation of workers fails: a replacement (`RayWorkerGroup.respawn`, which counts
generations in `BALLAST_WORKER_GENERATION`) and an engine rebuilt in place run the call again
normally, so one fault is one failure. Unset (the default) nothing happens; a value naming no kind is
refused when the trainer starts (`armed`).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NamedTuple, Optional

from ballast.single_controller.worker import GENERATION_ENV

ENV = "BALLAST_ROLLOUT_FAULT"
KINDS = ("kill", "hang", "raise")


class RolloutEngineError(RuntimeError):
    """The inference engine failed inside a living worker: it can be rebuilt in place."""


def engine_failures() -> tuple:
    """The exception types that mean the inference engine itself failed (so a new one may succeed):
    ours, and vLLM's dead-engine and failed-generation errors when vLLM is loaded in this process."""
    types = [RolloutEngineError]
    if "vllm" in sys.modules:
        try:
            from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
        except ImportError:  # a vLLM without them (or a stand-in module in tests)
            return tuple(types)
        types += [EngineDeadError, EngineGenerateError]
    return tuple(types)


class Fault(NamedTuple):
    kind: str
    call_index: int
    rank: int


def armed(environ=os.environ) -> Optional[Fault]:
    """The fault `BALLAST_ROLLOUT_FAULT` names, None when unset; ValueError naming the variable and the
    kinds when its value is not `<kind>@<call_index>[:<rank>]`."""
    value = environ.get(ENV, "").strip()
    if not value:
        return None
    kind, _, rest = value.partition("@")
    call, _, rank = rest.partition(":")
    rank = rank or "0"
    if kind not in KINDS or not all(p.isascii() and p.isdigit() for p in (call, rank)):
        raise ValueError(f"{ENV}={value!r} must be <kind>@<call_index>[:<rank>] with a kind among {list(KINDS)}")
    return Fault(kind, int(call), int(rank))


class FaultState:
    """A worker's view of the armed fault: fires at most once per process, never in a replacement."""

    def __init__(self, rank: int, environ=os.environ) -> None:
        fault = armed(environ)
        first_generation = environ.get(GENERATION_ENV, "0") == "0"
        self._fault = fault if fault is not None and fault.rank == rank and first_generation else None

    def at_generate(self, call_index: Optional[int]) -> None:
        """Fail here if the armed fault names this generate call (training calls only: validation
        calls have indices of their own, far from the steps')."""
        fault = self._fault
        if fault is None or call_index != fault.call_index:
            return
        self._fault = None
        print(f"ballast: {ENV}: rollout worker pid {os.getpid()} fails ({fault.kind}) at call {call_index}",
              file=sys.stderr, flush=True)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise RolloutEngineError(f"{ENV}: the engine failed at generate call {call_index}")
