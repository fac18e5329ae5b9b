"""`Worker`: the base class of every Ray actor in a worker group.

It reads its place in the group from the environment the group set (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT), pins its thread pools so colocated processes do not oversubscribe the cores, and
runs every group call through `_ballast_call`, which drops the results of non-collect ranks before
they are shipped (SP/TP peers would otherwise send the same Batch several times).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class MeshInfo:
    """Where a worker sits in one role's data-parallel layout."""

    dp_rank: int
    dp_size: int
    is_collect: bool  # the one worker per dp rank whose result the driver keeps (sp/tp rank 0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _set_threads(num_threads: int) -> None:
    import torch

    # torch._C.set_num_threads keeps working after vLLM has wrapped torch.set_num_threads.
    torch._C.set_num_threads(max(1, num_threads))


class Worker:
    """Base class for group workers. Subclasses decorate their public methods with `@register`."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._mesh: Dict[str, MeshInfo] = {}
        threads = os.environ.get("BALLAST_NUM_THREADS")
        if threads:
            _set_threads(int(threads))

    # -- used by the worker group ------------------------------------------------------------
    def _ballast_node_info(self) -> Dict[str, object]:
        import ray

        return {"ip": ray.util.get_node_ip_address(), "port": _free_port(), "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def _ballast_set_master(self, addr: str, port: int) -> None:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)

    def _ballast_call(self, method: str, collect: bool, *args, **kwargs):
        result = getattr(self, method)(*args, **kwargs)
        return result if collect else None

    def _ballast_mesh_info(self, role: str) -> MeshInfo:
        if role not in self._mesh:
            raise ValueError(f"worker rank {self.rank} declared no mesh for role {role!r} "
                             f"(declared: {sorted(self._mesh) or 'none'}; call set_mesh_info in init)")
        return self._mesh[role]

    # -- for subclasses ----------------------------------------------------------------------
    def set_mesh_info(self, role: str, dp_rank: int, dp_size: int, is_collect: bool) -> None:
        self._mesh[role] = MeshInfo(dp_rank, dp_size, is_collect)
