"""Small worker classes for the controller tests (shipped to Ray by value)."""

import os
import time

import torch

from ballast.protocol import Batch
from ballast.single_controller import Dispatch, Execute, Worker, register


class EchoWorker(Worker):
    def __init__(self, sp: int = 1, tp: int = 1):
        super().__init__()
        self.set_mesh_info("actor", self.rank // sp, self.world_size // sp, self.rank % sp == 0)
        self.set_mesh_info("rollout", self.rank // tp, self.world_size // tp, self.rank % tp == 0)
        self.seen = []

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self):
        return {"rank": self.rank, "world": self.world_size, "pid": os.getpid(),
                "master": (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")),
                "threads": torch.get_num_threads(),
                "malloc": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero(self, value):
        return (self.rank, value)

    @register(Dispatch.ALL_TO_ALL)
    def scale(self, value):
        return value * (self.rank + 1)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def tag(self, batch: Batch) -> Batch:
        out = batch.select(["idx"])
        out["owner"] = torch.full((len(batch),), self.rank, dtype=torch.int64)
        return out

    @register(Dispatch.DP_COMPUTE_PROTO, pad=True)
    def tag_padded(self, batch: Batch) -> Batch:
        return self.tag(batch)

    def _observe(self, role, batch):
        info = self._ballast_mesh_info(role)
        out = batch.select(["idx"])
        out["dp_rank"] = torch.full((len(batch),), info.dp_rank, dtype=torch.int64)
        out["worker"] = torch.full((len(batch),), self.rank, dtype=torch.int64)
        self.seen.append((role, batch["idx"].tolist()))
        return out

    @register(Dispatch.MESH, mesh="actor")
    def actor_step(self, batch: Batch) -> Batch:
        return self._observe("actor", batch)

    @register(Dispatch.MESH, mesh="rollout")
    def rollout_step(self, batch: Batch) -> Batch:
        return self._observe("rollout", batch)

    @register(Dispatch.MESH, mesh="actor", blocking=False)
    def produce(self, batch: Batch) -> Batch:
        out = batch.select(["idx"])
        out["value"] = batch["idx"].float() * 2
        return out

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce_per_rank(self, batch: Batch) -> Batch:
        return self.produce(batch)

    @register(Dispatch.ONE_TO_ALL)
    def history(self):
        return list(self.seen)

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank):
        if self.rank == rank:
            raise ValueError(f"boom from rank {self.rank}")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def die_on(self, rank):
        if self.rank == rank:
            os._exit(3)
        time.sleep(0.5)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def hang_on(self, rank, seconds):
        if self.rank == rank:
            time.sleep(seconds)
        return self.rank


class ConsumerWorker(Worker):
    def __init__(self, sp: int = 2):
        super().__init__()
        self.set_mesh_info("critic", self.rank // sp, self.world_size // sp, self.rank % sp == 0)

    @register(Dispatch.MESH, mesh="critic")
    def consume(self, batch: Batch) -> Batch:
        out = batch.select(["idx"])
        out["value_plus_one"] = batch["value"] + 1
        out["pid"] = torch.full((len(batch),), os.getpid(), dtype=torch.int64)
        return out

    @register(Dispatch.ONE_TO_ALL)
    def say(self, text):
        print(f"{text} from rank {self.rank} via print", flush=True)
        os.write(2, f"{text} from rank {self.rank} via fd 2\n".encode())  # as C++ warnings are written
        return self.rank
