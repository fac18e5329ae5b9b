"""The workers of the actor / rollout / reference side, one class per deployment, each holding exactly
its roles (`ActorRoles`, `RolloutRole`), one process per device over one torch.distributed
world: `ActorRolloutRefWorker` (colocated: the weights move into the engine in place),
`TrainerWorker` (a trainer pool beside a rollout pool: `export_weights` into the object store) and
`RolloutWorker` (that rollout pool: the exports come with the generate calls and, with partial
rollouts, from the driver's mailbox mid-call). The weight source is chosen when the worker is built
(`weight_sources`).

Creation order matters (see `rollout/vllm_backend.py` and docs/rollout.md): the process group and the
FSDP engines come first, then the vLLM engine, which builds its own groups on that world and must be
kept for the process's life. "actor" and "ref" are (dp, sp) meshes of their engines (SP peers get the
same chunk, sp rank 0 answers); generation uses DP_COMPUTE_PROTO over all ranks, one agent-loop
conversation per row on the request-level engine (`agent_loop.runner`); a TP group all-gathers its
prompts, its leader runs the conversations while its peers replay the engine steps, and each rank
returns its own slice.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Dict, Optional

import torch
from tensordict import TensorDict

from ballast.engine import MiniBatchPlan, PhasePlan, TrainEngine, build_engine
from ballast.engine.dist import init_distributed, resolve_device_type
from ballast.protocol import Batch, Output
from ballast.protocol.fields import ACTOR_LOSS, columns_read_by
from ballast.single_controller import Dispatch, Worker, register
from ballast.single_controller.object_store import DEFAULT_BUCKET_BYTES, StoredWeights, put_buckets
from ballast.workers.agent_loop.runner import AgentLoopRunner
from ballast.workers.agent_loop.tp import new_tp_group
from ballast.workers.on_policy import OldLogProbMode, SelfOldLogProbLoss, rows_after_first
from ballast.workers.perf import mfu_metrics, peak_flops
from ballast.workers.rollout import build_backend
from ballast.workers.rollout.base import RolloutBackend, resolve_rollout_dtype
from ballast.workers.rollout.faults import FaultState, RolloutEngineError, engine_failures
from ballast.workers.spec import ActorRolloutRefSpec, GenerateArgs
from ballast.workers.sync_check import start_log_probs
from ballast.workers.train_loop import UpdateResult, run_train_loop
from ballast.workers.weight_sources import (
    ColocatedActorWeights, MailboxWeights, StoredExportWeights, WeightSource, add_metrics, probe_for, trainer_dtype,
)

GENERATE_SECONDS_METRIC = "timing_s/generate_on_worker"  # the call's own seconds (sync + generation)
# engines rebuilt in place during the call (0 or 1 per worker) and the seconds that took; the driver
# adds them to the replacements of a rollout pool it made itself (`trainer.step.rollout_recovery`)
RECOVERIES_METRIC = "rollout/recoveries"
RECOVERY_SECONDS_METRIC = "timing_s/rollout_recovery"
ENGINE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def engine_input(batch: Batch, extra=()) -> TensorDict:
    """The TensorDict the engine reads: the sequence layout plus whatever the loss needs (`extra`: the
    columns the table `ballast.protocol.fields` says it reads; those the batch lacks are left out)."""
    keys = [k for k in dict.fromkeys((*ENGINE_KEYS, *extra)) if k in batch.tensor_keys]
    return batch.tensors.select(*keys)


def _per_engine_seed(config, engine_index: int):
    """Give each data-parallel rollout engine its own seed stream (TP peers share one engine's).

    Otherwise row r of every engine would sample with the same seed, and the copies of one prompt
    that land on different engines at the same row would be identical. The index enters every
    sampling seed (`sampling_seed`), for training and validation sampling alike.
    """
    return dataclasses.replace(config, engine_index=engine_index)


def _start(worker: Worker, spec: ActorRolloutRefSpec, roles: str, actor: bool, rollout: bool) -> str:
    """Check that `spec` names the deployment's roles, then join the process group and seed; returns
    the device type."""
    if (spec.actor is not None, spec.rollout is not None) != (actor, rollout):
        raise ValueError(f"{type(worker).__name__} holds {roles}: its spec has actor={spec.actor is not None}, "
                         f"rollout={spec.rollout is not None}")
    device_type = resolve_device_type(spec.actor.device if actor else "auto")
    init_distributed(device_type, timeout_s=spec.dist_timeout_s)
    torch.manual_seed(spec.seed)
    return device_type


class ActorRoles:
    """The actor (always) and the reference (a ref engine, the adapter-off actor, or none) of a worker."""

    spec: ActorRolloutRefSpec
    actor: TrainEngine
    ref: Optional[TrainEngine]  # its own engine only; None with LoRA (`spec.ref_in_actor`) or without a ref
    _peak_flops: Optional[float]
    # What `update_actor` marks: an engine in this process serving the actor's weights is then stale.
    # The colocated worker's `rollout` and property override these; a worker without one keeps them.
    rollout = None
    _weights_stale = False

    def _build_actor_roles(self) -> None:
        """Build the engines (collective over the default group) and declare their meshes."""
        spec = self.spec
        self.actor = build_engine(spec.actor, seed=spec.seed)
        p = self.actor.parallel
        self.set_mesh_info("actor", p.dp_rank, p.dp_size, p.collects)
        self.ref = build_engine(spec.ref, seed=spec.seed) if spec.ref is not None else None
        ref = self.actor if spec.ref_in_actor else self.ref  # LoRA: the actor without its adapter
        if ref is not None:
            p = ref.parallel
            self.set_mesh_info("ref", p.dp_rank, p.dp_size, p.collects)

    def _require(self, engine, role):
        if engine is None:
            raise ValueError(f"worker rank {self.rank} has no {role} role")
        return engine

    @register(Dispatch.MESH, mesh="actor")
    def compute_log_prob(self, batch: Batch, plan: PhasePlan) -> Output:
        """Old log-probs (and per-token entropy, for the metric) under the current actor."""
        actor = self._require(self.actor, "actor")
        data = engine_input(batch)
        start = time.perf_counter()
        out = actor.infer_batch(data, plan.mini_batches[0], temperature=self.spec.temperature, calculate_entropy=True)
        mfu = mfu_metrics("actor_infer", actor, data, time.perf_counter() - start, self._peak_flops, passes=1,
                          shared_prompts=plan.mini_batches[0].shared_prompts)
        return Output(Batch({"old_log_probs": out["log_probs"].cpu(), "entropy": out["entropy"].cpu()}),
                      {k: [v] for k, v in mfu.items()})

    @register(Dispatch.MESH, mesh="ref")
    def compute_ref_log_prob(self, batch: Batch, plan: PhasePlan) -> Batch:
        """Reference log-probs: the ref engine's or, with LoRA, the actor's with the adapter switched off."""
        if self.spec.ref_in_actor:
            actor = self._require(self.actor, "actor")
            with actor.adapter_disabled():
                out = actor.infer_batch(engine_input(batch), plan.mini_batches[0], temperature=self.spec.temperature)
        else:
            ref = self._require(self.ref, "ref")
            out = ref.infer_batch(engine_input(batch), plan.mini_batches[0], temperature=self.spec.temperature)
        return Batch({"ref_log_prob": out["log_probs"].cpu()})

    @register(Dispatch.MESH, mesh="actor")
    def update_actor(self, batch: Batch, plan: PhasePlan, old_log_probs: OldLogProbMode = OldLogProbMode.PASS,
                     rest_plan: Optional[MiniBatchPlan] = None) -> UpdateResult:
        """Train on this rank's chunk of `batch[plan.rows]`. With `old_log_probs` "update"/"partial" the
        old log-probs come from the update itself: a forward-only pass over the rows after the first
        mini-batch (planned by `rest_plan`), then the first mini-batch's own; both are returned. With
        "rollout" (bypass rollout correction: the loss reads `rollout_log_probs`) the log-probs each
        row had when it was trained are returned instead."""
        actor = self._require(self.actor, "actor")
        data = engine_input(batch, columns_read_by(ACTOR_LOSS))
        metrics: Dict[str, float] = {}
        first_loss, rest = None, None
        start = time.perf_counter()
        if OldLogProbMode(old_log_probs).from_update:
            rest, metrics = self._old_log_probs_before_update(data, plan, rest_plan)
            first_loss = SelfOldLogProbLoss(self.spec.actor_train.loss_fn)
        result = run_train_loop(actor, data, plan, self.spec.actor_train, "actor", first_loss_fn=first_loss,
                                later_old_log_probs=None if rest is None else rest[0],
                                record_log_probs=OldLogProbMode(old_log_probs) is OldLogProbMode.ROLLOUT)
        seconds = time.perf_counter() - start
        # A pipeline's losses run on its last stage only (`parallel.collects`), the rank whose result
        # the driver keeps; its peers recorded nothing.
        if first_loss is not None and actor.parallel.collects:
            first = first_loss.collect(plan.mini_batches[0].for_rank(actor.parallel.dp_rank))
            result.old_log_probs = torch.cat([first[0], rest[0]]) if rest is not None else first[0]
            result.entropy = torch.cat([first[1], rest[1]]) if rest is not None else first[1]
        result.metrics.update(metrics)
        epochs = plan.epochs
        result.metrics.update(mfu_metrics("actor", actor, data, seconds, self._peak_flops, passes=3 * epochs,
                                          shared_prompts=plan.mini_batches[0].shared_prompts))
        self._weights_stale = self.rollout is not None
        return result

    def _old_log_probs_before_update(self, data: TensorDict, plan: PhasePlan, rest_plan: Optional[MiniBatchPlan]):
        """((log-probs, entropy) of this rank's rows after its first mini-batch, or None; metrics)."""
        actor = self.actor
        rows = rows_after_first(plan, actor.parallel.dp_rank)
        if rest_plan is None:
            if any(len(mb) for mb in plan.mini_batches[1:]):
                raise ValueError("update_actor: old log-probs from the update over several mini-batches need rest_plan")
            return None, {}
        start = time.perf_counter()
        rest = data[torch.as_tensor(rows)]
        out = actor.infer_batch(rest, rest_plan, temperature=self.spec.temperature, calculate_entropy=True)
        seconds = time.perf_counter() - start
        metrics = mfu_metrics("actor_infer", actor, rest, seconds, self._peak_flops, passes=1,
                              shared_prompts=rest_plan.shared_prompts)
        metrics["timing_s/old_log_prob"] = seconds
        return (out["log_probs"].cpu(), out["entropy"].cpu()), metrics

    # ------------------------------------------------------------------ checkpoints
    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.actor.save_checkpoint(os.path.join(path, "actor"))

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.actor.load_checkpoint(os.path.join(path, "actor"))
        self._weights_stale = True  # a colocated engine serves the weights from before the load

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        self.actor.export_hf(path)

    @register(Dispatch.ONE_TO_ALL)
    def actor_state_fingerprint(self) -> float:
        """Sum of |w| over the actor's full weights: a cheap 'did the parameters change' check."""
        total = 0.0
        for _, tensor in self.actor.iter_full_state_dict():
            total += float(tensor.float().abs().sum())
        return total


class RolloutRole:
    """The rollout engine and its agent loops, its weights from one `WeightSource`."""

    spec: ActorRolloutRefSpec
    rollout: RolloutBackend
    _agents: AgentLoopRunner
    _weights: WeightSource

    def _build_rollout(self) -> None:
        tp = self.spec.rollout.tensor_model_parallel_size
        self._tp_group = new_tp_group(tp) if tp > 1 else None
        self._faults = FaultState(self.rank)
        self._build_engine()

    def _build_engine(self) -> None:
        tp = self.spec.rollout.tensor_model_parallel_size
        group = self._tp_group
        self.rollout = build_backend(_per_engine_seed(self.spec.rollout, self.rank // tp))
        if group is not None and torch.distributed.get_process_group_ranks(group) != self.rollout.tp_group_ranks:
            raise RuntimeError(f"TP group ranks {torch.distributed.get_process_group_ranks(group)} differ from "
                               f"the engine's TP group {self.rollout.tp_group_ranks}")
        self._agents = AgentLoopRunner(self.rollout, self.spec.agent, group)

    def _recover_engine(self, failure: Optional[Exception], call: GenerateArgs, metrics) -> float:
        """After a generation in which some rank's engine failed (`failure` on this one, or None): a
        failed engine is replaced with a new one and every rank the weight source ties together brings
        its engine to the weights it served (colocated: the actor's weights, a collective sync on every
        rank), so a rank that failed can generate its chunk again; the seconds it took. A TP group would
        have to rebuild as a unit: every rank then raises, none is left waiting."""
        if self._tp_group is not None:
            raise RolloutEngineError(f"rollout rank {self.rank}: a rollout engine failed ({failure}); an engine "
                                     "of a tensor-parallel group is not rebuilt in place")
        start = time.perf_counter()
        if failure is not None:
            print(f"[ballast] rollout rank {self.rank}: the engine failed ({failure}); rebuilding it in place",
                  flush=True)
            try:
                self.rollout.shutdown()
            except Exception as stuck:  # a failed engine may not stop cleanly; the new one replaces it anyway
                print(f"[ballast] rollout rank {self.rank}: the failed engine's shutdown raised {stuck!r}", flush=True)
            self._build_engine()
        self._weights.rebind(self.rollout)
        add_metrics(metrics, self._weights.before(call))
        return time.perf_counter() - start

    def _generate(self, prompts: Batch, call: GenerateArgs):
        sampling = self.spec.rollout_val_sampling if call.validate else None
        return self._agents.generate(prompts, sampling, call_index=call.call_index, updates=self._weights.during(call))

    @register(Dispatch.DP_COMPUTE_PROTO, pad=True)
    def generate_sequences(self, prompts: Batch, call: GenerateArgs) -> Output:
        """Prompts (left-padded) -> prompts + responses, one agent-loop conversation per row (the
        single-turn loop unless the row or the config names another), under the weights the worker's
        source brings (`call.weights`, and mid-call ones with partial rollouts: they interrupt the turns
        in flight, which resume under them). An engine that fails is rebuilt in place and its chunk
        generated again with the same seeds (`_recover_engine`). Metrics: the weight syncs' seconds
        (`timing_s/update_weights`) when this call synced, the weight-sync check's figures, how many
        loads landed mid-call (`rollout/partial/weight_loads`) and engines rebuilt (`rollout/recoveries`)."""
        call_start = time.perf_counter()
        metrics = self._weights.before(call)
        failure, result, rebuilt = None, None, 0.0
        try:
            if not call.validate:
                self._faults.at_generate(call.call_index)
            result = self._generate(prompts, call)
        except engine_failures() as err:  # the conversations start over, with their own seeds, on a new engine
            failure = err
        if self._weights.any_failed(failure is not None):
            rebuilt = self._recover_engine(failure, call, metrics)
            if failure is not None:
                result = self._generate(prompts, call)
        self._weights.after(metrics)
        metrics[RECOVERIES_METRIC] = [float(failure is not None)]
        metrics[RECOVERY_SECONDS_METRIC] = [rebuilt if failure is not None else 0.0]
        metrics[GENERATE_SECONDS_METRIC] = [time.perf_counter() - call_start]
        non_tensors = {**prompts.non_tensors, **result.columns}
        return Output(Batch(result.tensors, non_tensors=non_tensors, meta=dict(prompts.meta)), metrics)


class ActorRolloutRefWorker(ActorRoles, RolloutRole, Worker):
    def __init__(self, spec: ActorRolloutRefSpec) -> None:
        super().__init__()
        self.spec = spec
        self._peak_flops: Optional[float] = None  # measured in init_model, for perf/mfu/*

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> Dict[str, object]:
        self._peak_flops = peak_flops(_start(self, self.spec, "the actor and the rollout", actor=True, rollout=True))
        self._build_actor_roles()
        self._build_rollout()
        self._weights = ColocatedActorWeights(self.rollout, self.actor, self.spec.weight_sync)
        return {"rank": self.rank, "pid": os.getpid(), **self._weights.start()}

    @property
    def _weights_stale(self) -> bool:
        """Whether the engine serves older weights than the actor (set by every update and checkpoint load)."""
        return self._weights.stale

    @_weights_stale.setter
    def _weights_stale(self, stale: bool) -> None:
        self._weights.stale = stale


class TrainerWorker(ActorRoles, Worker):
    def __init__(self, spec: ActorRolloutRefSpec) -> None:
        super().__init__()
        self.spec = spec
        self._peak_flops: Optional[float] = None
        self._export_probe = None  # with the check on: (probe tokens, the model directory's log-probs on them)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> Dict[str, object]:
        self._peak_flops = peak_flops(_start(self, self.spec, "the actor only", actor=True, rollout=False))
        self._build_actor_roles()
        if self.spec.weight_sync.check:  # the exports carry the probe and the start's log-probs
            tokens = probe_for(self.spec.weight_sync, self.actor.model.config.vocab_size)
            self._export_probe = (tokens, start_log_probs(self.actor, tokens))
        return {"rank": self.rank, "pid": os.getpid()}

    @register(Dispatch.ONE_TO_ALL)
    def export_weights(self, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Optional[StoredWeights]:
        """Gather the actor's full weights (merged with its adapter, if it has one) and put them into the
        object store in buckets; rank 0 returns the references (with the probe's log-probs when the
        weight-sync check is on), the other ranks None. Collective over the actor's mesh."""
        named = self.actor.iter_full_state_dict(layered=self.spec.weight_sync.layered)
        if self.rank == 0:
            refs, count, nbytes = put_buckets(named, bucket_bytes, self._transfer_dtype())
        else:
            for _ in named:  # every rank takes part in each bucket's gather
                pass
        probe = trained = start = None
        if self._export_probe is not None:
            probe, start = self._export_probe
            trained = self.actor.probe_log_probs(list(probe))
        if self.rank != 0:
            return None
        return StoredWeights(tuple(refs), count, nbytes, version, probe, trained, trainer_dtype(self.actor), start)

    def _transfer_dtype(self) -> Optional[torch.dtype]:
        name = self.spec.weight_sync.transfer_dtype
        if name is None:
            return None
        return getattr(torch, resolve_rollout_dtype(name, self.actor.parallel.device_type))


class RolloutWorker(RolloutRole, Worker):
    def __init__(self, spec: ActorRolloutRefSpec, mailbox=None) -> None:
        """`mailbox`: the driver's `WeightMailbox` with partial rollouts (None: weights arrive with calls)."""
        super().__init__()
        self.spec = spec
        self._mailbox = mailbox

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> Dict[str, object]:
        _start(self, self.spec, "the rollout only", actor=False, rollout=True)
        self._build_rollout()
        sync = self.spec.weight_sync
        self._weights = (StoredExportWeights(self.rollout, sync, self.rank) if self._mailbox is None
                         else MailboxWeights(self.rollout, sync, self.rank, self._mailbox))
        return {"rank": self.rank, "pid": os.getpid(), **self._weights.start()}
