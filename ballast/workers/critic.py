"""The critic worker: a value model on its own (dp, sp) mesh, trained with the clipped value loss."""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from ballast.engine import TrainEngine, build_engine
from ballast.engine.dist import init_distributed, resolve_device_type
from ballast.protocol import Batch
from ballast.protocol.fields import CRITIC_LOSS, columns_read_by
from ballast.single_controller import Dispatch, Worker, register
from ballast.workers.actor_rollout_ref import engine_input
from ballast.workers.spec import CriticSpec
from ballast.engine import PhasePlan
from ballast.workers.train_loop import UpdateResult, run_train_loop


class CriticWorker(Worker):
    def __init__(self, spec: CriticSpec) -> None:
        super().__init__()
        self.spec = spec
        self.critic: Optional[TrainEngine] = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> Dict[str, object]:
        init_distributed(resolve_device_type(self.spec.critic.device), timeout_s=self.spec.dist_timeout_s)
        torch.manual_seed(self.spec.seed)
        self.critic = build_engine(self.spec.critic, seed=self.spec.seed)
        p = self.critic.parallel
        self.set_mesh_info("critic", p.dp_rank, p.dp_size, p.collects)
        return {"rank": self.rank, "pid": os.getpid()}

    @register(Dispatch.MESH, mesh="critic")
    def compute_values(self, batch: Batch, plan: PhasePlan) -> Batch:
        out = self.critic.infer_batch(engine_input(batch), plan.mini_batches[0])
        return Batch({"values": out["values"].cpu()})

    @register(Dispatch.MESH, mesh="critic")
    def update_critic(self, batch: Batch, plan: PhasePlan) -> UpdateResult:
        data = engine_input(batch, columns_read_by(CRITIC_LOSS))
        return run_train_loop(self.critic, data, plan, self.spec.train, "critic")

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.critic.save_checkpoint(os.path.join(path, "critic"))

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.critic.load_checkpoint(os.path.join(path, "critic"))
