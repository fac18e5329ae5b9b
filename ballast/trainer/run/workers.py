"""Creating the worker groups of a run: one resource pool, the colocated actor/rollout/ref group and,
for PPO, a critic group sharing the same devices; with `trainer.v1.trainer_mode=separate_async` the
first pool holds a trainer-only group and a second pool a rollout-only group (with partial rollouts
built with the driver's weight mailbox), each deployment its own worker class."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

from ballast.balance import PlanObjective
from ballast.single_controller import RayWorkerGroup, ResourcePool
from ballast.trainer.run.builders import WorkerSpecs
from ballast.trainer.run.reward_model import create_group as create_reward_model_group
from ballast.trainer.config import BallastConfig, DerivedSizes
from ballast.trainer.config.off_policy import overlap
from ballast.trainer.step.plans import phase_objectives
from ballast.trainer.run.tracking import worker_log_dir
from ballast.single_controller.object_store import WeightMailbox
from ballast.workers.actor_rollout_ref import ActorRolloutRefWorker, RolloutWorker, TrainerWorker
from ballast.workers.critic import CriticWorker

# Passed to every worker process: in-process vLLM engines, caches inside the run, no telemetry.
WORKER_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}
# Forwarded when set on the driver (also to workers of a Ray cluster started elsewhere); NCCL_DEBUG makes
# NCCL log its set-up into the workers' logs, which scripts/gpu_smoke.sh checks.
FORWARDED_ENV = ("VLLM_CACHE_ROOT", "VLLM_LOGGING_LEVEL", "TORCHINDUCTOR_CACHE_DIR", "BALLAST_CACHE_DIR", "HF_HOME", "TMPDIR",
                 "NCCL_DEBUG")


def worker_env(listed: Sequence[str] = ()) -> dict:
    """What every worker's runtime environment sets: the defaults above, then the driver's values of
    those, of `FORWARDED_ENV` and of `listed` (`ray_init.worker_env_vars`). A local Ray's workers
    inherit nothing else of the driver's environment but what `ballast.trainer.run.ray_env` lets
    through; a cluster's workers get the cluster's own environment plus these."""
    env = dict(WORKER_ENV_DEFAULTS)
    names = [*WORKER_ENV_DEFAULTS, *FORWARDED_ENV, *listed]
    env.update({k: os.environ[k] for k in names if k in os.environ})
    return env


@dataclass
class Workers:
    pool: ResourcePool
    actor_rollout: RayWorkerGroup
    critic: Optional[RayWorkerGroup]
    # The planning objective of each (role, backward) phase, from how its engine synchronises.
    objectives: Dict[tuple, PlanObjective] = field(default_factory=dict)
    # separate_async: the rollout-only group on a pool of its own (None: the rollout is colocated)
    rollout: Optional[RayWorkerGroup] = None
    rollout_pool: Optional[ResourcePool] = None
    # reward.reward_model.enable: the resident reward model (on its own pool, or None: on `pool`)
    reward_model: Optional[RayWorkerGroup] = None
    reward_model_pool: Optional[ResourcePool] = None
    # partial rollouts: where the driver posts every export and the rollout group looks mid-call
    mailbox: Optional[object] = None

    @property
    def world_size(self) -> int:
        return self.actor_rollout.world_size

    @property
    def num_devices(self) -> int:
        """Every device (CPU: worker process) of the run, the rollout pool's included (throughput per GPU)."""
        return self.world_size + (self.rollout.world_size if self.rollout is not None else 0)

    @property
    def generator(self) -> RayWorkerGroup:
        """The group that generates: the rollout pool's, or the colocated one."""
        return self.rollout if self.rollout is not None else self.actor_rollout

    def shutdown(self) -> None:
        for group in (self.reward_model, self.rollout, self.critic, self.actor_rollout):
            if group is not None:
                group.kill()
        for pool in (self.reward_model_pool, self.rollout_pool, self.pool):
            if pool is not None:
                pool.remove()


def create_workers(cfg: BallastConfig, sizes: DerivedSizes, specs: WorkerSpecs) -> Workers:
    t = cfg.trainer
    use_gpu = t.device == "cuda" or (t.device == "auto" and _cuda_available())
    pool = ResourcePool([t.n_gpus_per_node] * t.nnodes, use_gpu=use_gpu, cpus_per_process=float(t.cpus_per_worker),
                        name=f"ballast_{os.getpid()}", ready_timeout_s=cfg.ray_init.timeout_s)
    workers: Optional[Workers] = None
    try:
        rm = specs.reward_model
        share = 1.0 / (1 + sizes.use_critic + (rm is not None and not rm.sizes.own_pool))
        env = worker_env(cfg.ray_init.worker_env_vars)
        logs = worker_log_dir(t.default_local_dir)
        trainer_cls = ActorRolloutRefWorker if specs.rollout is None else TrainerWorker
        actor = RayWorkerGroup(pool, trainer_cls, init_args=(specs.actor_rollout_ref,),
                               name="actor_rollout_ref", device_share=share, env=env, timeout_s=t.worker_timeout_s,
                               log_dir=logs)
        critic = None
        if sizes.use_critic:
            critic = RayWorkerGroup(pool, CriticWorker, init_args=(specs.critic,), name="critic",
                                    device_share=share, env=env, timeout_s=t.worker_timeout_s, log_dir=logs)
        arr = specs.actor_rollout_ref
        # With LoRA the reference phase runs on the actor's engine (adapter off), so it is planned like one.
        engines = {"actor": arr.actor, "ref": arr.actor if arr.ref_in_actor else arr.ref,
                   "critic": specs.critic.critic if specs.critic is not None else None}
        objectives = phase_objectives({k: v for k, v in engines.items() if v is not None}, pool.world_size,
                                      "cuda" if use_gpu else "cpu")
        workers = Workers(pool, actor, critic, objectives)
        if specs.rollout is not None:
            r = cfg.actor_rollout_ref.rollout
            workers.rollout_pool = ResourcePool([r.n_gpus_per_node] * r.nnodes, use_gpu=use_gpu,
                                                cpus_per_process=float(t.cpus_per_worker),
                                                name=f"ballast_rollout_{os.getpid()}",
                                                ready_timeout_s=cfg.ray_init.timeout_s)
            workers.mailbox = WeightMailbox.remote() if overlap(cfg).partial_rollout else None
            workers.rollout = RayWorkerGroup(workers.rollout_pool, RolloutWorker,
                                             init_args=(specs.rollout, workers.mailbox), name="rollout", env=env,
                                             timeout_s=t.worker_timeout_s, log_dir=logs)
        # Each group forms its own torch.distributed world; initialise them one after the other.
        report = weight_sync_report(actor.init_model())
        if report:
            print(report, flush=True)
        if critic is not None:
            critic.init_model()
        if rm is not None:
            workers.reward_model, workers.reward_model_pool = create_reward_model_group(
                cfg, rm, pool, share, use_gpu, env=env, timeout_s=t.worker_timeout_s, log_dir=logs)
            workers.reward_model.init_model()  # loaded once: resident for the whole run
        if workers.rollout is not None:
            workers.rollout.init_model()
            print(f"[ballast] separate_async: {actor.world_size} trainer and {workers.rollout.world_size} rollout "
                  "worker(s) on separate pools; the weights reach the rollout through the object store after every "
                  "step" + (" (merged with the LoRA adapter)" if specs.actor_rollout_ref.actor.lora.enabled else "")
                  + ("; partial rollouts: new weights interrupt the generations in flight, which resume under them"
                     if overlap(cfg).partial_rollout else ""), flush=True)
        return workers
    except BaseException:
        # A group that failed to start must not outlive the attempt: its placement groups (named after
        # this process) would refuse the next session in the same process, e.g. a notebook's retry.
        if workers is not None:
            workers.shutdown()
        else:
            pool.remove()  # removing the placement groups also ends the actors placed in them
        raise


def weight_sync_report(init_info: list) -> str:
    """The start-up line saying what a weight sync moves into the rollout (LoRA runs; empty otherwise)."""
    info = next((i for i in init_info if isinstance(i, dict) and "weight_sync" in i), None)
    if info is None or info["weight_sync"] == "full":
        return ""
    if info["weight_sync"] == "adapter":
        return (f"[ballast] LoRA weight sync: adapter only (rank {info['adapter_rank']}); the rollout engine "
                "serves it next to the base weights it loaded")
    why = info.get("adapter_unavailable") or "actor_rollout_ref.model.lora.merge=True"
    return f"[ballast] LoRA weight sync: merged weights (the rollout cannot serve the adapter: {why})"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
