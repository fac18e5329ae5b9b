"""Where a rollout worker's weights come from: one source per worker, chosen when the worker is built.

* `ColocatedActorWeights`: the actor in the same process. After an update (or a level-2 sleep that
  dropped them) the actor's weights move into the engine before the next generation: in full, merged
  with the LoRA adapter, or the adapter alone (`weight_sync.SyncMode`); the engine sleeps after it,
  handing the memory back to training.
* `StoredExportWeights`: a rollout pool of its own. The trainer's export (full weights, an adapter
  merged in, bucketed in the object store) comes with the generate call (`GenerateArgs.weights`) and
  is loaded unless the engine already serves it or newer.
* `MailboxWeights`: the same, plus partial rollouts. During a training generation the worker looks into
  the driver's `WeightMailbox` for newer exports, which interrupt the requests in flight (they resume
  under the new weights); a validation generation keeps the weights it started with.

A full-weight run and a LoRA run take the same source. Each load is followed by the weight-sync check
when it is on (`ballast.workers.sync_check`).
"""

from __future__ import annotations

import abc
import time
from typing import Dict, Optional

import torch

from ballast.engine.dist import device_of
from ballast.engine.parallelize import compute_dtype
from ballast.models import load_tokenizer
from ballast.single_controller.object_store import MailboxUpdates, StoredWeights, iter_buckets
from ballast.workers.rollout.resume import WeightUpdates
from ballast.workers.rollout.weight_sync import sync_actor, sync_mode
from ballast.workers.spec import GenerateArgs, WeightSyncSpec
from ballast.workers.sync_check import METRIC_PREFIX as SYNC_CHECK_PREFIX
from ballast.workers.sync_check import SyncCheck, probe_tokens

UPDATE_WEIGHTS_METRIC = "timing_s/update_weights"
PARTIAL_LOADS_METRIC = "rollout/partial/weight_loads"
# a rollout pool of its own: the weight version each worker served at the end of a call (-1: the
# model directory's); the driver logs the lowest, so a worker left behind shows
SERVED_VERSION_METRIC = "rollout/served_version"

Metrics = Dict[str, list]


class WeightSource(abc.ABC):
    """Per generate call: `before` (bring the engine up to date and awake; the metrics of what it
    loaded), `during` (where newer weights are looked for mid-call; None: nowhere), `after` (fold
    what arrived mid-call into the call's metrics). `start`: at start-up, what the driver reports."""

    def start(self) -> Dict[str, object]:
        return {}

    @abc.abstractmethod
    def before(self, call: GenerateArgs) -> Metrics:
        """Bring the engine up to date and awake before `call` generates; the metrics of what it loaded."""

    def during(self, call: GenerateArgs) -> Optional[WeightUpdates]:
        return None

    def after(self, metrics: Metrics) -> None:
        pass

    @abc.abstractmethod
    def rebind(self, backend) -> None:
        """After an engine failure: `backend` (a new engine, or on a rank whose engine survived, the same
        one) is brought to the weights the failed one served by the next `before`."""

    def any_failed(self, failed_here: bool) -> bool:
        """Whether a rank this source ties together had its engine fail in this call (every such rank
        calls it, once per call). Exports are loaded rank by rank: only this rank's failure counts."""
        return failed_here


def probe_for(spec: WeightSyncSpec, vocab_size: int) -> tuple:
    """The weight-sync check's probe tokens (ids below `vocab_size`)."""
    return probe_tokens(load_tokenizer(spec.tokenizer_path), vocab_size, spec.probe_max_tokens)


def trainer_dtype(actor) -> str:
    """The dtype the actor computes in ("bfloat16", ...): the weight-sync check's precision on its side."""
    return str(compute_dtype(actor.cfg, actor.parallel.device_type)).removeprefix("torch.")


def _timed(check) -> Metrics:
    start = time.perf_counter()
    result = check()
    result[f"{SYNC_CHECK_PREFIX}/seconds"] = time.perf_counter() - start
    return {k: [v] for k, v in result.items()}


class ColocatedActorWeights(WeightSource):
    def __init__(self, backend, actor, spec: WeightSyncSpec) -> None:
        self.backend, self.actor, self.spec = backend, actor, spec
        self.mode = sync_mode(actor.adapter is not None, backend)
        # The engine starts from the model directory alone: an adapter (also one loaded from disk) has
        # to reach it before the first rollout, and every rollout must then name it. Set by every update.
        self.stale = actor.adapter is not None
        self._check: Optional[SyncCheck] = None

    def start(self) -> Dict[str, object]:
        """Calibrate the check while both sides still hold the model directory's weights, then put the
        engine to sleep (GPU: the memory goes to training until the first generate)."""
        adapter = self.actor.adapter
        info: Dict[str, object] = {"weight_sync": str(self.mode), "adapter_rank": adapter.max_rank if adapter else 0,
                                   "adapter_unavailable": self.backend.adapter_unavailable}
        if self.spec.check:
            tokens = probe_for(self.spec, min(self.backend.vocab_size, self.actor.model.config.vocab_size))
            self._check = SyncCheck(tokens, self.spec.check_tolerance, self.backend.config.resolved_dtype(),
                                    trainer_dtype(self.actor))
            info.update(self._check.calibrate_colocated(self.backend, self.actor))
        self.backend.sleep()
        return info

    def before(self, call: GenerateArgs) -> Metrics:
        """Weights first, then the KV cache: the actor's gathered full tensors are freed before the cache
        comes back."""
        metrics: Metrics = {}
        synced = self.stale or self.backend.needs_weights
        if synced:
            start = time.perf_counter()
            sync_actor(self.backend, self.actor, self.mode, self.spec.layered)
            self.stale = False
            # verl's timing_s/update_weights; the driver takes the slowest worker
            metrics[UPDATE_WEIGHTS_METRIC] = [time.perf_counter() - start]
        self.backend.wake_up()
        if synced and self._check is not None:
            metrics.update(_timed(lambda: self._check.run(self.backend, self.actor,
                                                                         f"the {self.mode} weights")))
        return metrics

    def after(self, metrics: Metrics) -> None:
        self.backend.sleep()

    def rebind(self, backend) -> None:
        # a new engine holds the model directory's weights; the sync gathers over every rank, so each
        # one takes part (a surviving engine gets the weights it has again)
        self.backend, self.stale = backend, True

    def any_failed(self, failed_here: bool) -> bool:
        """One all-reduce per call: the actor's weights reach an engine by a collective gather."""
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return failed_here
        flag = torch.tensor([float(failed_here)], device=device_of(self.actor.parallel.device_type))
        torch.distributed.all_reduce(flag)
        return bool(flag.item())


class StoredExportWeights(WeightSource):
    def __init__(self, backend, spec: WeightSyncSpec, rank: int) -> None:
        self.backend, self.spec, self.rank = backend, spec, rank
        self.version = -1  # the weight version the engine serves (-1: the model directory's)
        self._served: Optional[StoredWeights] = None  # ... and the export it came from
        self._reload: Optional[StoredWeights] = None  # what a rebuilt engine must load first
        self._check: Optional[SyncCheck] = None

    def before(self, call: GenerateArgs) -> Metrics:
        self.backend.wake_up()
        metrics: Metrics = {}
        if self._reload is not None:
            metrics, self._reload = self.load(self._reload), None
        weights = call.weights
        if weights is not None and weights.version > self.version:  # else none, or loaded mid-call before
            add_metrics(metrics, self.load(weights))
        return metrics

    def rebind(self, backend) -> None:
        self.backend, self.version, self._reload = backend, -1, self._served

    def after(self, metrics: Metrics) -> None:
        metrics[SERVED_VERSION_METRIC] = [float(self.version)]  # the driver logs every worker's lowest

    def load(self, weights: StoredWeights) -> Metrics:
        """Stream an export in from the object store, then check it against the trainer's probe log-probs
        when the export carries them (the check is calibrated before the first load, while the engine
        still serves the model directory's weights)."""
        checked = weights.probe_log_probs is not None
        if checked and self._check is None:
            self._check = SyncCheck(weights.probe_tokens, self.spec.check_tolerance,
                                    self.backend.config.resolved_dtype(), weights.trainer_dtype)
            self._check.calibrate(self._served_probe(), weights.start_log_probs)
        start = time.perf_counter()
        loaded = self.backend.load_weights(iter_buckets(weights.buckets))
        if loaded != weights.num_tensors:
            raise RuntimeError(f"rollout rank {self.rank} loaded {loaded} of the {weights.num_tensors} exported tensors")
        metrics: Metrics = {UPDATE_WEIGHTS_METRIC: [time.perf_counter() - start]}
        self.version, self._served = weights.version, weights
        if checked:
            what = f"weight version {weights.version} from the trainer pool"
            metrics.update(_timed(lambda: self._check.verdict(self._served_probe(),
                                                                             weights.probe_log_probs, what)))
        return metrics

    def _served_probe(self) -> torch.Tensor:
        return self.backend.prompt_log_probs([list(self._check.tokens)])[0]


class MailboxWeights(StoredExportWeights):
    def __init__(self, backend, spec: WeightSyncSpec, rank: int, mailbox) -> None:
        super().__init__(backend, spec, rank)
        self.mailbox = mailbox
        self._midway: Metrics = {}
        self._updates: Optional[MailboxUpdates] = None

    def during(self, call: GenerateArgs) -> Optional[WeightUpdates]:
        self._midway = {}
        self._updates = None if call.validate else MailboxUpdates(
            self.mailbox, self.version, lambda w: add_metrics(self._midway, self.load(w)))
        return self._updates

    def after(self, metrics: Metrics) -> None:
        if self._updates is not None:
            add_metrics(metrics, self._midway)
            metrics[PARTIAL_LOADS_METRIC] = [float(self._updates.loads)]
        super().after(metrics)


def add_metrics(into: Metrics, more: Metrics) -> None:
    """Fold one weight load's metrics into a call's: seconds add up, the check's errors keep the worst."""
    for key, values in more.items():
        if key in into:
            combine = sum if key == UPDATE_WEIGHTS_METRIC or key.endswith("/seconds") else max
            values = [combine([*into[key], *values])]
        into[key] = list(values)
