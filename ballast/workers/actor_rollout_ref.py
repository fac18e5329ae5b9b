"""The colocated actor / rollout / reference worker: one process per device, holding the roles its
spec names, over one torch.distributed world.

Creation order matters (see `rollout/vllm_backend.py` and docs/rollout.md): the process group
and the FSDP engines come first, then the vLLM engine, which builds its own groups on that world and
must be kept for the process's life. Data arrives per role mesh: "actor" and "ref" are (dp, sp)
meshes of their engines (SP peers get the same chunk, sp rank 0 answers); generation uses
DP_COMPUTE_PROTO over all ranks, and a TP group all-gathers its prompts, generates once and each rank
returns its own slice.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Dict, Optional

import torch
from tensordict import TensorDict

from ballast.engine import TrainEngine
from ballast.engine.dist import init_distributed, resolve_device_type
from ballast.protocol import METRICS_KEY, Batch
from ballast.single_controller import Dispatch, Worker, register
from ballast.workers.on_policy import FROM_UPDATE_KEY, ROW_INDEX_KEY, check_marked_rows, update_log_prob_train_spec
from ballast.workers.perf import mfu_metrics, peak_flops
from ballast.workers.rollout import build_backend, new_tp_group, tp_generate
from ballast.workers.spec import ActorRolloutRefSpec
from ballast.workers.train_loop import LOG_PROB_PLAN_KEY, MINI_BATCH_PLANS_KEY, UpdateResult, run_train_loop

UPDATE_WEIGHTS_METRIC = "timing_s/update_weights"

ENGINE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")


def engine_input(batch: Batch, extra=()) -> TensorDict:
    """The TensorDict the engine reads: the sequence layout plus whatever the loss needs."""
    keys = [k for k in (*ENGINE_KEYS, *extra) if k in batch.tensor_keys]
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
        self._tp_group = None
        self._weights_stale = False
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
            self.actor = TrainEngine(spec.actor, seed=spec.seed)
            p = self.actor.parallel
            self.set_mesh_info("actor", p.dp_rank, p.dp_size, p.sp_rank == 0)
        if spec.ref is not None:
            self.ref = TrainEngine(spec.ref, seed=spec.seed)
            p = self.ref.parallel
            self.set_mesh_info("ref", p.dp_rank, p.dp_size, p.sp_rank == 0)
        if spec.rollout is not None:
            tp = spec.rollout.tensor_model_parallel_size
            if tp > 1:
                self._tp_group = new_tp_group(tp)
            self.rollout = build_backend(_per_engine_seed(spec.rollout, self.rank // tp))
            self.rollout.sleep()  # GPU: hand the memory to training until the first generate
        return {"rank": self.rank, "pid": os.getpid()}

    # ------------------------------------------------------------------ rollout
    @register(Dispatch.DP_COMPUTE_PROTO, pad=True)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """Prompts (left-padded) -> prompts + responses. `meta["validate"]` switches to greedy sampling."""
        if self.rollout is None:
            raise ValueError(f"worker rank {self.rank} has no rollout role")
        # Weights first, then the KV cache (wake_up): the actor's gathered full tensors are freed
        # before the cache comes back. A level-2 sleep discarded the engine's weights, so they are
        # reloaded after every such sleep, not only after an actor update.
        meta = dict(prompts.meta)
        if self._weights_stale or self.rollout.needs_weights:
            start = time.perf_counter()
            self.rollout.load_weights(self._require(self.actor, "actor").iter_full_state_dict())
            self._weights_stale = False
            # verl's timing_s/update_weights; the driver takes the slowest worker
            meta[METRICS_KEY] = {UPDATE_WEIGHTS_METRIC: [time.perf_counter() - start]}
        self.rollout.wake_up()
        sampling = self.spec.rollout_val_sampling if prompts.meta.get("validate") else None
        out = tp_generate(self.rollout, prompts.tensors.select(*PROMPT_KEYS), self._tp_group, sampling,
                          call_index=prompts.meta.get("rollout_call_index"))
        self.rollout.sleep()
        return Batch(out, non_tensors=prompts.non_tensors, meta=meta)

    # ------------------------------------------------------------------ actor
    def _require(self, engine, role):
        if engine is None:
            raise ValueError(f"worker rank {self.rank} has no {role} role")
        return engine

    @register(Dispatch.MESH, mesh="actor")
    def compute_log_prob(self, batch: Batch) -> Batch:
        """Old log-probs (and per-token entropy, for the metric) under the current actor."""
        actor = self._require(self.actor, "actor")
        data = engine_input(batch)
        start = time.perf_counter()
        out = actor.infer_batch(data, self.spec.actor_infer, temperature=self.spec.temperature,
                                calculate_entropy=True, plan=batch.meta.get(LOG_PROB_PLAN_KEY))
        mfu = mfu_metrics("actor_infer", actor, data, time.perf_counter() - start, self._peak_flops, passes=1)
        return Batch({"old_log_probs": out["log_probs"].cpu(), "entropy": out["entropy"].cpu()},
                     meta={"metrics": {k: [v] for k, v in mfu.items()}})

    @register(Dispatch.MESH, mesh="ref")
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        ref = self._require(self.ref, "ref")
        out = ref.infer_batch(engine_input(batch), self.spec.ref_infer, temperature=self.spec.temperature)
        return Batch({"ref_log_prob": out["log_probs"].cpu()})

    @register(Dispatch.MESH, mesh="actor")
    def update_actor(self, batch: Batch) -> UpdateResult:
        actor = self._require(self.actor, "actor")
        plans = batch.meta.get(MINI_BATCH_PLANS_KEY)
        train, wrapper = self.spec.actor_train, None
        extra = ("old_log_probs", "advantages", "ref_log_prob")
        if FROM_UPDATE_KEY in batch:  # the driver left these rows' old log-probs to the update
            check_marked_rows(batch[FROM_UPDATE_KEY], train.mini_batch_samples_per_rank, train.ppo_epochs,
                              shuffled_per_rank=plans is None and train.shuffle)
            batch[ROW_INDEX_KEY] = torch.arange(len(batch))
            train, wrapper = update_log_prob_train_spec(train)
            extra += (FROM_UPDATE_KEY, ROW_INDEX_KEY)
        data = engine_input(batch, extra)
        start = time.perf_counter()
        result = run_train_loop(actor, data, train, actor.parallel.dp_rank, "actor", plans=plans)
        seconds = time.perf_counter() - start
        if wrapper is not None:
            result.update_log_probs = wrapper.collect()
        result.metrics.update(mfu_metrics("actor", actor, data, seconds, self._peak_flops, passes=3 * train.ppo_epochs))
        self._weights_stale = self.rollout is not None
        return result

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
