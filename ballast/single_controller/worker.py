"""`Worker`: the base class of every Ray actor in a worker group.

It reads its place in the group from the environment the group set (RANK, WORLD_SIZE,
BALLAST_NODE_LOCAL_RANK, MASTER_ADDR/PORT), points LOCAL_RANK at its own GPU (see
`visible_device_index`), pins its thread pools so colocated processes do not oversubscribe the
cores, sends its output to a log file when the group names one, and runs every group call through
`_ballast_call`, which drops the results of non-collect ranks before they are shipped (SP/TP peers
would otherwise send the same Batch several times).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Dict, Optional, Sequence


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


def visible_device_index(assigned_ids: Sequence, visible_devices: Optional[str]) -> int:
    """The CUDA device index, in this process's visible set, of the first GPU Ray assigned to it.

    LOCAL_RANK must be this index, not the worker's slot on its node: torch.cuda.set_device and
    vLLM's external_launcher (device = cuda:LOCAL_RANK) both take it as a device ordinal. Ray sets
    each GPU actor's CUDA_VISIBLE_DEVICES to its own GPU(s), so rank 1 of a node sees one device and
    its ordinal is 0, not 1. With RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES Ray leaves the variable
    alone: the ordinal is then the id's position in it, or the id itself when it is unset.
    """
    if not assigned_ids:
        raise ValueError("no GPU assigned to this worker (ray.get_gpu_ids() is empty)")
    first = str(assigned_ids[0]).strip()
    if visible_devices is None or not visible_devices.strip():
        if not first.isdigit():
            raise ValueError(f"Ray assigned GPU {first!r} but CUDA_VISIBLE_DEVICES is unset: cannot map it to an ordinal")
        return int(first)
    visible = [d.strip() for d in visible_devices.split(",") if d.strip()]
    if first not in visible:
        raise ValueError(f"Ray assigned GPU {first!r}, which is not in CUDA_VISIBLE_DEVICES={visible_devices!r}")
    return visible.index(first)


def _ray_gpu_ids() -> list:
    """The GPUs Ray assigned to this process; empty outside Ray or for a CPU-only worker."""
    try:
        import ray
    except ImportError:  # the Worker is also used without Ray (unit tests, scripts)
        return []
    return list(ray.get_gpu_ids()) if ray.is_initialized() else []


# Set by the worker group when the run keeps worker output in files (see `RayWorkerGroup(log_dir=)`).
LOG_FILE_ENV = "BALLAST_WORKER_LOG_FILE"
# How many times the group replaced its workers before starting this one (0: an original worker).
GENERATION_ENV = "BALLAST_WORKER_GENERATION"


def redirect_output(path: str) -> None:
    """Append this process's stdout and stderr to `path`, at the file-descriptor level.

    The fd level matters: the noisy output of a worker (vLLM/Triton warnings, NUMA-binding notices
    from torch's C++ code, model-loading progress bars) does not all go through `sys.stdout`.
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _set_threads(num_threads: int) -> None:
    import torch

    # torch._C.set_num_threads keeps working after vLLM has wrapped torch.set_num_threads.
    torch._C.set_num_threads(max(1, num_threads))


class Worker:
    """Base class for group workers. Subclasses decorate their public methods with `@register`."""

    def __init__(self) -> None:
        if os.environ.get(LOG_FILE_ENV):
            redirect_output(os.environ[LOG_FILE_ENV])
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        # The slot on the node (0..bundles-1), for anything per-node; never a device ordinal.
        self.node_local_rank = int(os.environ.get("BALLAST_NODE_LOCAL_RANK", os.environ.get("LOCAL_RANK", "0")))
        gpu_ids = _ray_gpu_ids()
        if gpu_ids:
            # Before any engine reads it: torch.cuda.set_device and vLLM take LOCAL_RANK as the ordinal.
            os.environ["LOCAL_RANK"] = str(visible_device_index(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES")))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # this process's CUDA device ordinal on GPU
        self._mesh: Dict[str, MeshInfo] = {}
        threads = os.environ.get("BALLAST_NUM_THREADS")
        if threads:
            _set_threads(int(threads))

    # -- used by the worker group ------------------------------------------------------------
    def _ballast_node_info(self) -> Dict[str, object]:
        import ray
        import torch

        return {"ip": ray.util.get_node_ip_address(), "port": _free_port(), "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(), "threads": torch.get_num_threads()}

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
