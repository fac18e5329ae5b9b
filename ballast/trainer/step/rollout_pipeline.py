"""The rollouts of the next steps, generated while this one trains (off-policy overlap), with the
synchronous trainer as the case of none generated ahead.

Each step's batch is made in two halves:

* `launch(step, prompts)` on the driver's main thread, with the prompts `draw(step)` took from the
  data: submit their generation to the workers without waiting. Submitting on the main thread, at one fixed point of the loop, fixes which
  weights generate the batch: a worker runs its calls in the order they were submitted, so a
  generation submitted before step t's update runs on the weights from before that update. Which
  version generated a batch therefore never depends on thread timing, and a run is reproducible.
* `finish(pending)` on one helper thread, in launch order: wait for the generation, then score it.
  A reward that waits on I/O (a verifier service) thereby overlaps the workers' training of the
  current step, and the driver's own per-step work overlaps the next generation.

The trainer launches the next batches right after a step's last weight-changing worker call
returns (`launch_through(step + 1 + ahead)`): a worker runs the generation after that update, so it
samples with the new weights when `ahead=0` (the synchronous trainer) and with weights `ahead`
updates old otherwise; either way the driver's end-of-step work (metrics, logging) and, with
`ahead>0`, the scoring of the batches ahead overlap the workers. `take(step)` waits for step's batch
(launching it first if nothing did: the first step, or after a resume) and re-raises on the main
thread whatever its halves raised (the data running out, a worker failure).

A checkpoint keeps what was launched and not yet trained (`saved_ahead`): the finished rollouts, in
order, and from the first whose generation or scoring failed on, the prompts of every later launched
step, so that the resumed run generates those again (with their own sampling seeds, on the
checkpoint's weights) instead of skipping them: the data loader's saved position is past all of
them.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from ballast.protocol import Batch, storage
from ballast.trainer.run.checkpoints import AHEAD_DIR, LEGACY_AHEAD_FILE, CheckpointError, legacy_pickle_refusal
from ballast.trainer.step.dynamic_sampling import GroupCollector

OFF_POLICY = "training/off_policy"
STALENESS = f"{OFF_POLICY}/trajectory_staleness"


@dataclass
class Rollout:
    """A step's generated and scored batch."""

    step: int
    version: int
    """Actor updates the weights that generated the step's first batch had seen (the step whose
    update preceded its launch, 0 before the first)."""
    batch: Optional[Batch]
    """None while `unfilled` is set."""
    timing: Dict[str, float] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)
    versions: Optional[np.ndarray] = None
    """Per row, when the rows come from generation batches of different versions (dynamic sampling
    completing an ahead batch with the latest weights); None: every row has `version`."""
    unfilled: Optional[object] = None
    """Dynamic sampling's collector when the first batch left the step short: the trainer draws the
    rest on the main thread when it takes the step (`RayPPOTrainer.fill_groups`)."""

    def row_versions(self) -> np.ndarray:
        if self.versions is not None:
            return self.versions
        return np.full(len(self.batch), self.version, dtype=np.int64)


@dataclass
class PendingRollout:
    """A step's generation, submitted and not yet waited for."""

    step: int
    version: int
    future: object
    """The worker group's future of the generation (its `get()` returns the `Output`)."""
    start: float
    """`time.perf_counter()` at submission."""


@dataclass
class Ahead:
    """What a checkpoint keeps of the steps launched and not yet trained (module docstring)."""

    rollouts: List[Rollout] = field(default_factory=list)
    """The finished rollouts from the checkpoint's next step on, in order."""
    relaunch: List[Tuple[int, Batch]] = field(default_factory=list)
    """(step, prompts) of the launched steps after them, to generate again on resume."""


class RolloutPipeline:
    def __init__(self, draw: Callable[[int], Batch], launch: Callable[[int, Batch], object],
                 finish: Callable[[object], Rollout], ahead: int, last_step: int) -> None:
        if ahead < 0:
            raise ValueError(f"ahead={ahead} must be >= 0")
        self.ahead, self.last_step = ahead, last_step
        self._draw, self._launch, self._finish = draw, launch, finish
        self._pending: Deque[Tuple[int, Future]] = collections.deque()
        self._prompts: Dict[int, Batch] = {}  # each launched step not yet taken: its prompts
        self._relaunch: Dict[int, Batch] = {}  # prompts a checkpoint kept for steps not yet launched again
        self._next = None  # the next step to launch
        self._work: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def take(self, step: int) -> Tuple[Rollout, float]:
        """(step's rollout, seconds the caller waited for it). Steps must be taken in order."""
        if self._next is None:
            self._next = step
        if self._pending and self._pending[0][0] != step:
            raise RuntimeError(f"rollout pipeline: step {step} taken, but step {self._pending[0][0]} is next")
        self.launch_through(step + self.ahead)
        start = time.perf_counter()
        launched, future = self._pending.popleft()
        assert launched == step, (launched, step)
        self._prompts.pop(step, None)
        rollout = future.result()  # re-raises what launch or finish raised
        return rollout, time.perf_counter() - start

    def launch_through(self, last: int) -> None:
        """Launch every step up to `last` (never past the run's last step) not launched yet."""
        if self._next is None:
            raise RuntimeError("rollout pipeline: launch_through() before the first take()")
        while self._next <= min(last, self.last_step):
            future: Future = Future()
            try:
                step = self._next
                prompts = self._relaunch.pop(step) if step in self._relaunch else self._draw(step)
                self._prompts[step] = prompts
                pending = self._launch(step, prompts)
            except Exception as err:  # raised when this step is taken, not before: earlier steps still train
                future.set_exception(err)
            else:
                self._serve()
                self._work.put((pending, future))
            self._pending.append((self._next, future))
            self._next += 1

    def _serve(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ballast-rollout", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            pending, future = self._work.get()
            if pending is None:
                return
            try:
                future.set_result(self._finish(pending))
            except BaseException as err:  # handed to the main thread by take()
                future.set_exception(err)

    def saved_ahead(self, next_step: int) -> Ahead:
        """What a checkpoint after step `next_step - 1` keeps (module docstring): the launched rollouts
        not yet taken, in order from `next_step`, finished (waits for them), up to the first that
        failed, then the prompts of that one and of every later launched step. A failure stays queued
        for `take()` to raise (the data ran out while launching, a worker error): the checkpoint is
        written without its rollout. Empty when the queue does not start at `next_step` (that step
        failed while it was being taken; the run is ending)."""
        kept: List[Rollout] = []
        for step, future in self._pending:
            if step != next_step + len(kept):
                break
            try:
                kept.append(future.result())
            except Exception:
                break
        relaunch: List[Tuple[int, Batch]] = []
        for step, _ in self._pending:
            if step == next_step + len(kept) + len(relaunch) and step in self._prompts:
                relaunch.append((step, self._prompts[step]))
        return Ahead(kept, relaunch)

    def restore(self, ahead: Ahead) -> None:
        """Queue what `saved_ahead` kept: a resumed run trains on exactly these rollouts, then generates
        the kept prompts again, each at its own step, before drawing new ones."""
        if self._pending or self._next is not None:
            raise RuntimeError("rollout pipeline: restore() must come before the first take()")
        steps = [r.step for r in ahead.rollouts] + [step for step, _ in ahead.relaunch]
        if steps and steps != list(range(steps[0], steps[0] + len(steps))):
            raise ValueError(f"rollout pipeline: the saved steps {steps} are not consecutive")
        for rollout in ahead.rollouts:
            future: Future = Future()
            future.set_result(rollout)
            self._pending.append((rollout.step, future))
        self._relaunch = dict(ahead.relaunch)
        if steps:
            self._next = steps[0] + len(ahead.rollouts)

    def close(self) -> None:
        """Stop the helper thread once it is idle (a rollout it is finishing is abandoned)."""
        if self._thread is not None:
            self._work.put((None, None))
            self._thread = None


def idle_metrics(timing: Dict[str, float]) -> Dict[str, float]:
    """Idle ratios of a step (`timing`: seconds per phase, with `step`, `wait_rollout` and, when the
    workers reported it, `gen_workers`): the trainer is idle while it waits for the step's batch; the
    rollout is idle for the part of a step's wall time its engines were not generating this batch."""
    step = timing.get("step", 0.0)
    if step <= 0:
        return {}
    metrics = {"perf/trainer_idle_ratio": min(timing.get("wait_rollout", 0.0) / step, 1.0)}
    if "gen_workers" in timing:
        metrics["perf/rollout_idle_ratio"] = max(1.0 - timing["gen_workers"] / step, 0.0)
    return metrics


def staleness_metrics(rollout: Rollout, step: int) -> Dict[str, float]:
    """verl's off-policy metrics, per sample. A sample's tokens were sampled by the weight versions
    [low, high] (one version unless partial rollouts resumed it under newer weights): `trajectory_
    staleness` counts the updates between its freshest weights and the policy trained at this step
    (verl's primary figure), `trajectory_staleness_worst` those from its oldest, `trajectory_spans` the
    versions it spans."""
    tokens = rollout.batch["rollout_versions"] if "rollout_versions" in rollout.batch.tensor_keys else None
    low, high = version_range(rollout.row_versions(), None if tokens is None else tokens.numpy())
    trained = step - 1
    out: Dict[str, float] = {}
    for name, values in (("trajectory_staleness", trained - high), ("trajectory_staleness_worst", trained - low),
                         ("trajectory_spans", high - low + 1)):
        values = values.astype(np.float64)
        out.update({f"{OFF_POLICY}/{name}/mean": float(values.mean()), f"{OFF_POLICY}/{name}/max": float(values.max()),
                    f"{OFF_POLICY}/{name}/min": float(values.min())})
    return out


def version_range(row_versions: np.ndarray, token_versions: Optional[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """Per row, the oldest and newest weight version that sampled its tokens. `token_versions` (rows x
    response tokens, -1 where the model sampled nothing) comes with partial rollouts; a row without
    any, or without the array, has its generation call's version."""
    low, high = row_versions.astype(np.int64), row_versions.astype(np.int64)
    if token_versions is None:
        return low, high
    sampled = token_versions >= 0
    has = sampled.any(axis=1)
    big = np.iinfo(np.int64).max
    low = np.where(has, np.where(sampled, token_versions, big).min(axis=1), low)
    high = np.where(has, np.where(sampled, token_versions, -1).max(axis=1), high)
    return low, high


def save_rollouts_ahead(path: str, ahead: Ahead) -> None:
    """Keep what was generated (or launched) ahead in checkpoint `path`: the data loader's saved
    position is past its prompts, and a resumed run trains on the rollouts exactly as the
    uninterrupted run would have, and generates the kept prompts again. Stored in files that cannot
    run code when read (`ballast.protocol.storage`)."""
    if ahead.rollouts or ahead.relaunch:
        storage.save(os.path.join(path, AHEAD_DIR), {"rollouts": [_rollout_state(r) for r in ahead.rollouts],
                                                     "relaunch": [{"step": s, "prompts": p} for s, p in ahead.relaunch]})


def load_rollouts_ahead(path: str) -> Ahead:
    """What `save_rollouts_ahead` kept in checkpoint `path` (nothing when it kept nothing; the plain list
    of rollouts earlier versions wrote is read too). A legacy pickle of them is refused, naming the
    file: loading it could run code."""
    legacy = os.path.join(path, LEGACY_AHEAD_FILE)
    if os.path.exists(legacy):
        raise CheckpointError(legacy_pickle_refusal(legacy))
    directory = os.path.join(path, AHEAD_DIR)
    if not os.path.isdir(directory):
        return Ahead()
    try:
        value = storage.load(directory)
        if isinstance(value, list):
            value = {"rollouts": value, "relaunch": []}
        return Ahead([_rollout_from_state(state) for state in value["rollouts"]],
                     [(int(item["step"]), item["prompts"]) for item in value["relaunch"]])
    except (storage.StorageError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{directory}: the rollouts generated ahead are unreadable: {err}") from None


def _rollout_state(r: Rollout) -> dict:
    return {"step": r.step, "version": r.version, "batch": r.batch, "timing": r.timing, "metrics": r.metrics,
            "versions": r.versions, "unfilled": r.unfilled.state() if r.unfilled is not None else None}


def _rollout_from_state(state: dict) -> Rollout:
    unfilled = GroupCollector.from_state(state["unfilled"]) if state["unfilled"] is not None else None
    return Rollout(int(state["step"]), int(state["version"]), state["batch"], dict(state["timing"]),
                   dict(state["metrics"]), state["versions"], unfilled)
