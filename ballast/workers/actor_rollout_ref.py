"""The colocated actor / rollout / reference worker: one process per device, holding the roles its
spec names, over one torch.distributed world.

Creation order matters (see `rollout/vllm_backend.py` and docs/rollout.md): the process group
and the FSDP engines come first, then the vLLM engine, which builds its own groups on that world and
must be kept for the process's life. Data arrives per role mesh: "actor" and "ref" are (dp, sp)
meshes of their engines (SP peers get the same chunk, sp rank 0 answers); generation uses
DP_COMPUTE_PROTO over all ranks and runs every row as an agent-loop conversation on the request-level
engine (`agent_loop.runner`); a TP group all-gathers its prompts, its leader runs the conversations
while its peers replay the engine steps, and each rank returns its own slice.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Dict, Optional

import torch
from tensordict import TensorDict

from ballast.engine import TrainEngine, build_engine
from ballast.engine.dist import init_distributed, resolve_device_type
from ballast.engine.parallelize import compute_dtype
from ballast.protocol import Batch, Output
from ballast.protocol.fields import ACTOR_LOSS, columns_read_by
from ballast.single_controller import Dispatch, Worker, register
from ballast.single_controller.object_store import (
    DEFAULT_BUCKET_BYTES, MailboxUpdates, StoredWeights, iter_buckets, put_buckets,
)
from ballast.engine import MiniBatchPlan, PhasePlan
from ballast.workers.on_policy import OldLogProbMode, SelfOldLogProbLoss, rows_after_first
from ballast.workers.perf import mfu_metrics, peak_flops
from ballast.workers.rollout import build_backend
from ballast.workers.rollout.base import resolve_rollout_dtype
from ballast.workers.rollout.weight_sync import SyncMode, sync_actor, sync_mode
from ballast.workers.agent_loop.runner import AgentLoopRunner
from ballast.workers.agent_loop.tp import new_tp_group
from ballast.workers.spec import ActorRolloutRefSpec
from ballast.models import load_tokenizer
from ballast.workers.sync_check import METRIC_PREFIX as SYNC_CHECK_PREFIX
from ballast.workers.sync_check import SyncCheck, probe_tokens, start_log_probs
from ballast.workers.train_loop import UpdateResult, run_train_loop

UPDATE_WEIGHTS_METRIC = "timing_s/update_weights"
PARTIAL_LOADS_METRIC = "rollout/partial/weight_loads"
GENERATE_SECONDS_METRIC = "timing_s/generate_on_worker"  # the call's own seconds (sync + generation)

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


class ActorRolloutRefWorker(Worker):
    def __init__(self, spec: ActorRolloutRefSpec) -> None:
        super().__init__()
        self.spec = spec
        self.actor: Optional[TrainEngine] = None
        self.ref: Optional[TrainEngine] = None
        self.rollout = None
        self._agents: Optional[AgentLoopRunner] = None  # the rollout's agent loops (every generate call)
        self._weights_stale = False
        self._sync_mode = SyncMode.FULL
        self._check: Optional[SyncCheck] = None  # the weight-sync check (None: off, or not calibrated yet)
        self._export_probe = None  # a trainer pool: (probe tokens, the model directory's log-probs on them)
        self._served_version = -1  # a rollout pool of its own: the weight version the engine serves
        self._peak_flops = None  # measured in init_model, for perf/mfu/*

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> Dict[str, object]:
        spec = self.spec
        any_engine = spec.actor or spec.ref
        device_type = resolve_device_type(any_engine.device if any_engine else "auto")
        init_distributed(device_type, timeout_s=spec.dist_timeout_s)
        torch.manual_seed(spec.seed)
        self._peak_flops = peak_flops(device_type)
        if spec.actor is not None:
            self.actor = build_engine(spec.actor, seed=spec.seed)
            p = self.actor.parallel
            self.set_mesh_info("actor", p.dp_rank, p.dp_size, p.collects)
        if spec.ref is not None:
            self.ref = build_engine(spec.ref, seed=spec.seed)
            p = self.ref.parallel
            self.set_mesh_info("ref", p.dp_rank, p.dp_size, p.collects)
        elif spec.ref_in_actor:  # LoRA: the reference is the actor without its adapter, on the actor's mesh
            p = self.actor.parallel
            self.set_mesh_info("ref", p.dp_rank, p.dp_size, p.collects)
        if spec.rollout is not None:
            tp = spec.rollout.tensor_model_parallel_size
            group = new_tp_group(tp) if tp > 1 else None
            self.rollout = build_backend(_per_engine_seed(spec.rollout, self.rank // tp))
            if group is not None and torch.distributed.get_process_group_ranks(group) != self.rollout.tp_group_ranks:
                raise RuntimeError(f"TP group ranks {torch.distributed.get_process_group_ranks(group)} differ from "
                                   f"the engine's TP group {self.rollout.tp_group_ranks}")
            self._agents = AgentLoopRunner(self.rollout, spec.agent, group)
        info = self._init_weight_sync()
        if self.actor is not None and self.rollout is not None:
            self.rollout.sleep()  # GPU: hand the memory to training until the first generate
        return {"rank": self.rank, "pid": os.getpid(), **info}

    def _init_weight_sync(self) -> Dict[str, object]:
        """Decide what a weight sync moves (reported to the driver, which says so at start-up), and
        calibrate the weight-sync check while both sides still hold the model directory's weights."""
        if self.actor is None:
            return {}
        check = self.spec.weight_sync
        if self.rollout is None:  # a trainer pool: its exports carry the probe and the start's log-probs
            if check.check:
                tokens = self._probe_tokens(self.actor.model.config.vocab_size)
                self._export_probe = (tokens, start_log_probs(self.actor, tokens))
            return {}
        has_adapter = self.actor.adapter is not None
        self._sync_mode = sync_mode(has_adapter, self.rollout)
        # The engine starts from the model directory alone: an adapter (also one loaded from disk) has
        # to reach it before the first rollout, and every rollout must then name it.
        self._weights_stale = has_adapter
        info: Dict[str, object] = {
            "weight_sync": str(self._sync_mode), "adapter_rank": self.actor.adapter.max_rank if has_adapter else 0,
            "adapter_unavailable": self.rollout.adapter_unavailable}
        if check.check:
            tokens = self._probe_tokens(min(self.rollout.vocab_size, self.actor.model.config.vocab_size))
            self._check = SyncCheck(tokens, check.check_tolerance, self.rollout.config.resolved_dtype(),
                                    self._trainer_dtype())
            info.update(self._check.calibrate_colocated(self.rollout, self.actor))
        return info

    def _probe_tokens(self, vocab_size: int) -> tuple:
        check = self.spec.weight_sync
        return probe_tokens(load_tokenizer(check.tokenizer_path), vocab_size, check.probe_max_tokens)

    def _trainer_dtype(self) -> str:
        return str(compute_dtype(self.actor.cfg, self.actor.parallel.device_type)).removeprefix("torch.")

    # ------------------------------------------------------------------ rollout
    @register(Dispatch.DP_COMPUTE_PROTO, pad=True)
    def generate_sequences(self, prompts: Batch, call_index: Optional[int] = None, validate: bool = False,
                           weights: Optional[StoredWeights] = None, updates=None) -> Output:
        """Prompts (left-padded) -> prompts + responses, one agent-loop conversation per row (the
        single-turn loop unless the row or the config names another). `call_index` enters every
        sampling seed; `validate` switches to the validation sampling parameters; `weights` (a rollout
        pool of its own) are loaded first, unless the engine already serves them or newer. `updates`
        (partial rollouts: a `WeightMailbox`) is where newer weights are looked for during the call;
        they interrupt the turns in flight, which resume under them. Metrics: the weight syncs' seconds
        (`timing_s/update_weights`) when this call synced, and how many syncs landed mid-call
        (`rollout/partial/weight_loads`)."""
        if self.rollout is None:
            raise ValueError(f"worker rank {self.rank} has no rollout role")
        call_start = time.perf_counter()
        if weights is not None and weights.version <= self._served_version:
            weights = None  # loaded during an earlier call (partial rollouts)
        metrics = self._load_stored(weights) if weights is not None else self._sync_from_actor()
        sampling = self.spec.rollout_val_sampling if validate else None
        midway: Dict[str, list] = {}
        source = None if updates is None else MailboxUpdates(
            updates, self._served_version, lambda w: _add_metrics(midway, self._load_stored(w)))
        result = self._agents.generate(prompts, sampling, call_index=call_index, updates=source)
        if source is not None:
            _add_metrics(metrics, midway)
            metrics[PARTIAL_LOADS_METRIC] = [float(source.loads)]
        if self.actor is not None:  # colocated: the memory goes back to training
            self.rollout.sleep()
        metrics[GENERATE_SECONDS_METRIC] = [time.perf_counter() - call_start]
        non_tensors = {**prompts.non_tensors, **result.columns}
        return Output(Batch(result.tensors, non_tensors=non_tensors, meta=dict(prompts.meta)), metrics)

    def _sync_from_actor(self) -> Dict[str, list]:
        """Colocated: move the actor's weights into the engine when an update (or a level-2 sleep) made
        them stale, then wake the engine. Weights first, then the KV cache: the actor's gathered full
        tensors are freed before the cache comes back."""
        metrics: Dict[str, list] = {}
        synced = self.actor is not None and (self._weights_stale or self.rollout.needs_weights)
        if synced:
            start = time.perf_counter()
            sync_actor(self.rollout, self._require(self.actor, "actor"), self._sync_mode, self.spec.weight_sync.layered)
            self._weights_stale = False
            # verl's timing_s/update_weights; the driver takes the slowest worker
            metrics[UPDATE_WEIGHTS_METRIC] = [time.perf_counter() - start]
        self.rollout.wake_up()
        if synced and self._check is not None:
            start = time.perf_counter()
            check = self._check.run(self.rollout, self.actor, f"the {self._sync_mode} weights")
            check[f"{SYNC_CHECK_PREFIX}/seconds"] = time.perf_counter() - start
            metrics.update({k: [v] for k, v in check.items()})
        return metrics

    def _load_stored(self, weights: StoredWeights) -> Dict[str, list]:
        """A rollout pool of its own: stream the trainer's exported weights in from the object store,
        then check them against the trainer's probe log-probs when the export carries them (the check is
        calibrated before the first load, while the engine still serves the model directory's weights)."""
        self.rollout.wake_up()
        checked = weights.probe_log_probs is not None
        if checked and self._check is None:
            self._check = SyncCheck(weights.probe_tokens, self.spec.weight_sync.check_tolerance,
                                    self.rollout.config.resolved_dtype(), weights.trainer_dtype)
            self._check.calibrate(self._served_probe(), weights.start_log_probs)
        start = time.perf_counter()
        loaded = self.rollout.load_weights(iter_buckets(weights.buckets))
        if loaded != weights.num_tensors:
            raise RuntimeError(f"rollout rank {self.rank} loaded {loaded} of the {weights.num_tensors} exported tensors")
        metrics: Dict[str, list] = {UPDATE_WEIGHTS_METRIC: [time.perf_counter() - start]}
        self._served_version = weights.version
        if checked:
            start = time.perf_counter()
            check = self._check.verdict(self._served_probe(), weights.probe_log_probs,
                                        f"weight version {weights.version} from the trainer pool")
            check[f"{SYNC_CHECK_PREFIX}/seconds"] = time.perf_counter() - start
            metrics.update({k: [v] for k, v in check.items()})
        return metrics

    def _served_probe(self) -> torch.Tensor:
        return self.rollout.prompt_log_probs([list(self._check.tokens)])[0]

    @register(Dispatch.ONE_TO_ALL)
    def export_weights(self, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Optional[StoredWeights]:
        """A rollout pool of its own: gather the actor's full weights (merged with its adapter, if it has
        one) and put them into the object store in buckets; rank 0 returns the references (with the
        probe's log-probs when the weight-sync check is on), the other ranks None. Collective over the
        actor's mesh."""
        actor = self._require(self.actor, "actor")
        named = actor.iter_full_state_dict(layered=self.spec.weight_sync.layered)
        if self.rank == 0:
            refs, count, nbytes = put_buckets(named, bucket_bytes, self._transfer_dtype())
        else:
            for _ in named:  # every rank takes part in each bucket's gather
                pass
        probe = trained = start = None
        if self._export_probe is not None:
            probe, start = self._export_probe
            trained = actor.probe_log_probs(list(probe))
        if self.rank != 0:
            return None
        return StoredWeights(tuple(refs), count, nbytes, version, probe, trained, self._trainer_dtype(), start)

    def _transfer_dtype(self) -> Optional[torch.dtype]:
        name = self.spec.weight_sync.transfer_dtype
        if name is None:
            return None
        return getattr(torch, resolve_rollout_dtype(name, self.actor.parallel.device_type))

    # ------------------------------------------------------------------ actor
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
        "rollout" (bypass rollout correction: `old_log_probs` holds the rollout's) the log-probs each
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
        self._require(self.actor, "actor").save_checkpoint(os.path.join(path, "actor"))

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self._require(self.actor, "actor").load_checkpoint(os.path.join(path, "actor"))
        self._weights_stale = self.rollout is not None

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        self._require(self.actor, "actor").export_hf(path)

    @register(Dispatch.ONE_TO_ALL)
    def actor_state_fingerprint(self) -> float:
        """Sum of |w| over the actor's full weights: a cheap 'did the parameters change' check."""
        total = 0.0
        for _, tensor in self._require(self.actor, "actor").iter_full_state_dict():
            total += float(tensor.float().abs().sum())
        return total


def _add_metrics(into: Dict[str, list], more: Dict[str, list]) -> None:
    """Fold one weight load's metrics into a call's: seconds add up, the check's errors keep the worst."""
    for key, values in more.items():
        if key in into:
            combine = sum if key == UPDATE_WEIGHTS_METRIC or key.endswith("/seconds") else max
            values = [combine([*into[key], *values])]
        into[key] = list(values)
