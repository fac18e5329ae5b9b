"""The reward-model worker: a frozen sequence classifier on its own (dp, sp) mesh, loaded once at
start-up and kept resident, scoring conversations through the same engine (and plan) as every other
forward-only phase.

Its input rows are the conversations as the reward model reads them (`ballast.trainer.step.reward_model`):
the whole conversation in the prompt columns and one placeholder token as the "response". The engine
reads a per-position head's output for response token j at the column before it, so the output for
the placeholder is the head at the conversation's last token: the score the classifier gives the
conversation (causal attention: the placeholder itself is never seen).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from ballast.engine import EngineConfig, PhasePlan, TrainEngine, build_engine
from ballast.engine.dist import init_distributed, resolve_device_type
from ballast.protocol import Batch
from ballast.single_controller import Dispatch, Worker, register
from ballast.workers.actor_rollout_ref import engine_input


@dataclass(frozen=True)
class RewardModelSpec:
    engine: EngineConfig
    seed: int = 0
    dist_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.engine.role != "reward":
            raise ValueError(f"a reward-model worker runs an engine of role 'reward', got {self.engine.role!r}")


class RewardModelWorker(Worker):
    def __init__(self, spec: RewardModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.engine: Optional[TrainEngine] = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> Dict[str, object]:
        init_distributed(resolve_device_type(self.spec.engine.device), timeout_s=self.spec.dist_timeout_s)
        torch.manual_seed(self.spec.seed)
        self.engine = build_engine(self.spec.engine, seed=self.spec.seed)
        p = self.engine.parallel
        self.set_mesh_info("reward_model", p.dp_rank, p.dp_size, p.collects)
        return {"rank": self.rank, "pid": os.getpid()}

    @register(Dispatch.MESH, mesh="reward_model")
    def compute_rm_scores(self, batch: Batch, plan: PhasePlan) -> Batch:
        """`values` (B, 1): the head's output at the placeholder, the score of each row's conversation
        (the engine's per-position output, as the critic's; these rows never join a step's batch)."""
        out = self.engine.infer_batch(engine_input(batch), plan.mini_batches[0])
        return Batch({"values": out["values"].cpu()})
