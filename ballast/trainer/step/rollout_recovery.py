"""Replacing a rollout pool's workers that died, hung or whose engine failed, without losing a sample.

A rollout pool of its own (`trainer.v1.trainer_mode=separate_async`) holds no training state, so a
failed member is replaced with its peers (one torch.distributed world, a TP group among them:
`RayWorkerGroup.respawn`), the new workers are initialised and pinged, and every generate call that
was in flight on the old ones is submitted again, in its original order, with its own arguments: the
same call index (hence the same sampling seeds) and the weights it was first submitted under. The new
workers serve nothing before those weights are loaded (a call's weights are loaded before it
generates), so no sample comes from the model directory's initial weights, none is dropped and none is
counted twice: the failed calls' partial results are discarded whole.

Which failures count: a worker process that died, a call unanswered past
`trainer.ballast_rollout_recovery.generate_timeout_s` (a hung worker), and an engine that raised
`RolloutEngineError`. Any other exception is a bug or bad input, and stops the run as before. After
`max_restarts` replacements the next failure stops the run, naming the worker and the count.

A colocated rollout shares its process with the actor's training state: its engine is rebuilt in place
by the worker itself, and a colocated worker that dies is a training-worker failure (the run stops and
resumes from its last checkpoint).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List

from ballast.single_controller import RayWorkerGroup, WorkerDiedError, WorkerError, WorkerTimeoutError
from ballast.trainer.config.schema.trainer import RolloutRecoveryConfig
from ballast.workers.actor_rollout_ref import RECOVERIES_METRIC, RECOVERY_SECONDS_METRIC

ENGINE_ERROR = "RolloutEngineError"
KEY = "trainer.ballast_rollout_recovery"


class RolloutFailedError(WorkerError):
    """The rollout pool failed once more than `max_restarts` allows, or could not be brought back."""


def recoverable(err: BaseException) -> bool:
    """Whether `err` is a rollout failure a replacement can cure (module docstring)."""
    if isinstance(err, (WorkerDiedError, WorkerTimeoutError)):
        return True
    return isinstance(err, WorkerError) and ENGINE_ERROR in str(err)


@dataclass
class GuardedCall:
    """One generate call on the rollout pool: its future, and how to submit it again."""

    resubmit: Callable[[], object]
    future: object
    generation: int
    recovery: "RolloutRecovery"
    replacements: int = 0  # the pool replacements this call's failure caused
    seconds: float = 0.0  # ... and what they took

    def get(self):
        """The call's `Output`, its metrics counting the replacements it caused (`rollout/recoveries`,
        `timing_s/rollout_recovery`)."""
        while True:
            try:
                result = self.future.get(timeout_s=self.recovery.config.generate_timeout_s)
            except WorkerError as err:
                if not recoverable(err):
                    raise
                self.recovery.recover(err, self)
                continue
            self.recovery.done(self)
            result.metrics[RECOVERIES_METRIC] = [float(self.replacements)]
            result.metrics[RECOVERY_SECONDS_METRIC] = [self.seconds]
            return result


@dataclass
class RolloutRecovery:
    group: RayWorkerGroup
    """The rollout-only worker group."""
    reinit: Callable[[RayWorkerGroup], None]
    """Initialises a respawned group (`init_model`) before any call reaches it."""
    config: RolloutRecoveryConfig
    restarts: int = 0
    _live: List[GuardedCall] = field(default_factory=list)
    # Calls are submitted on the driver's main thread and waited for (and recovered) on the pipeline's
    # helper thread: a submission waits for a replacement in progress, so that every call in flight on
    # the old workers reaches the new ones before any later call does.
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def submit(self, submit: Callable[[], object], again: Callable[[], object]) -> GuardedCall:
        """Submit a generate call under recovery: `submit()` and `again()` return the group's future,
        the latter for the same call on replaced workers (with the weights the first was submitted
        under, which the new workers do not have)."""
        with self._lock:
            call = GuardedCall(again, submit(), self.group.generation, self)
            self._live.append(call)
            return call

    def done(self, call: GuardedCall) -> None:
        with self._lock:
            self._live = [c for c in self._live if c is not call]

    def recover(self, err: WorkerError, failed: GuardedCall) -> None:
        """Replace the pool if `failed` ran on the current workers, then submit again every call still
        in flight on replaced ones, in submission order."""
        with self._lock:
            if failed.generation == self.group.generation:
                failed.seconds += self._replace(err)
                failed.replacements += 1
            for call in self._live:  # in submission order; `failed` is among them
                if call.generation < self.group.generation:
                    call.future, call.generation = call.resubmit(), self.group.generation

    def _replace(self, err: WorkerError) -> float:
        """Replace the pool; the seconds it took."""
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if self.restarts >= self.config.max_restarts:
            raise RolloutFailedError(
                f"the rollout pool failed after {self.restarts} replacement(s), the most "
                f"{KEY}.max_restarts={self.config.max_restarts} allows: {first_line}") from None
        start = time.perf_counter()
        self.restarts += 1
        print(f"[ballast] rollout failure ({first_line}); replacing the {self.group.world_size} rollout worker(s) "
              f"(replacement {self.restarts} of at most {self.config.max_restarts})", flush=True)
        ended = self.group.respawn()
        try:
            self.group.ping(self.config.health_check_timeout_s)  # every new worker answers
            self.reinit(self.group)
        except WorkerError as again:
            raise RolloutFailedError(f"the replaced rollout pool did not start (pids before: {ended}): {again}") from None
        seconds = time.perf_counter() - start
        print(f"[ballast] rollout pool replaced in {seconds:.1f}s; the calls in flight run again with their own seeds "
              "and weights", flush=True)
        return seconds


def rollout_recovery(workers, config: RolloutRecoveryConfig) -> "RolloutRecovery | None":
    """The recovery of a rollout pool of its own (None when the rollout is colocated)."""
    if workers.rollout is None:
        return None
    return RolloutRecovery(workers.rollout, lambda group: group.init_model(), config)
