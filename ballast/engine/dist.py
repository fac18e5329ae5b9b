"""Process group and the (dp, sp) device mesh of one engine.

Ranks are laid out row-major on a (dp, sp) mesh: the `sp` ranks of one SP group are consecutive
(rank = dp_rank * sp + sp_rank) and hold the same micro-batches. The DP group of a rank is the ranks
with the same sp_rank. The parameters are laid out over the `param_mesh`: one copy sharded over the
flattened dp x sp mesh (all ranks) or, with `fsdp_size=k`, one copy per group of k consecutive ranks
(k = 1: a whole replica per rank). That layout is independent of the (dp, sp) layout: every rank's
gradient is summed either way.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def resolve_device_type(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("engine device='cuda' but torch.cuda.is_available() is False")
    return device


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Gather every rank's `input` into `output` (rank-major along dim 0).

    torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single` and deprecated the old name;
    the project supports torch >= 2.11, where only the old name exists. Looked up at each call.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def init_distributed(device_type: str, timeout_s: float = 1800.0) -> None:
    """Initialise the default process group from torchrun's environment (once per process).

    gloo on CPU; on CUDA nccl for device tensors plus gloo for host tensors (CPU offload keeps
    sharded gradients and optimizer state in host memory, and the grad-norm reduction and DCP then
    communicate host tensors). Without torchrun variables a single-rank group is created in-process,
    so the engine also runs as a plain `python` script.
    """
    if dist.is_initialized():
        return
    backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device_type == "cuda":
            torch.cuda.set_device(_cuda_ordinal())
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _cuda_ordinal() -> int:
    """LOCAL_RANK as a CUDA device ordinal, checked against the devices this process can see."""
    ordinal = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if not 0 <= ordinal < count:
        raise ValueError(
            f"LOCAL_RANK={ordinal} is not a device ordinal: this process sees {count} CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); LOCAL_RANK must index the "
            "visible devices, not the process's slot on the node"
        )
    return ordinal


@dataclass
class ParallelState:
    """Who this rank is on the (dp, sp) mesh, and the groups the engine communicates over."""

    mesh: DeviceMesh  # 2-D, dim names ("dp", "sp")
    # How the parameters are laid out: the 1-D flattening of dp x sp (one copy, sharded over every
    # rank), or a 2-D ("replicate", "shard") mesh of world / shard_size copies, each on shard_size
    # consecutive ranks (FSDP2 hybrid sharding; whole replicas when shard_size is 1).
    param_mesh: DeviceMesh
    dp_group: dist.ProcessGroup
    sp_group: dist.ProcessGroup
    dp_size: int
    sp_size: int
    dp_rank: int
    sp_rank: int
    device_type: str

    @property
    def world_size(self) -> int:
        return self.dp_size * self.sp_size

    @property
    def collects(self) -> bool:
        """Whether this rank answers for its SP group (every SP peer holds the same results)."""
        return self.sp_rank == 0

    @property
    def shard_size(self) -> int:
        """Ranks that share one copy of the parameters (the world unless there are replicas)."""
        return self.param_mesh.size(self.param_mesh.ndim - 1)

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The group of this rank's peers in the other replicas (hybrid sharding, whole replicas),
        else None. (`build_parallel_state` makes the mesh 2-D only when there are two or more copies.)"""
        return self.param_mesh.get_group(0) if self.param_mesh.ndim == 2 else None

    @property
    def device(self) -> torch.device:
        return device_of(self.device_type)


def device_of(device_type: str) -> torch.device:
    """This rank's device: its current CUDA device (set by `init_distributed`) or the CPU."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_shard_size(fsdp_size: int, world: int) -> int:
    """Ranks per parameter shard group: `world` for -1 or anything >= world (verl's rule), else
    `fsdp_size`, which must divide the world."""
    if fsdp_size == -1 or fsdp_size >= world:
        return world
    if fsdp_size < 1 or world % fsdp_size:
        raise ValueError(f"fsdp_size={fsdp_size} must divide the world size {world} (or be -1: shard over every rank)")
    return fsdp_size


def build_parallel_state(sp_size: int, device_type: str, fsdp_size: int = -1) -> ParallelState:
    """Build the (dp, sp) mesh and the parameter mesh (see `resolve_shard_size`) over the default group."""
    if not dist.is_initialized():
        raise RuntimeError("call init_distributed() (or torch.distributed.init_process_group) first")
    world = dist.get_world_size()
    if sp_size < 1 or world % sp_size:
        raise ValueError(f"world size {world} is not divisible by ulysses_sequence_parallel_size={sp_size}")
    dp_size = world // sp_size
    mesh = init_device_mesh(device_type, (dp_size, sp_size), mesh_dim_names=("dp", "sp"))
    shard = resolve_shard_size(fsdp_size, world)
    if shard == world:
        param_mesh = mesh["dp", "sp"]._flatten("dp_sp")
    else:
        param_mesh = init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    return ParallelState(
        mesh=mesh,
        param_mesh=param_mesh,
        dp_group=mesh["dp"].get_group(),
        sp_group=mesh["sp"].get_group(),
        dp_size=dp_size,
        sp_size=sp_size,
        dp_rank=mesh.get_local_rank("dp"),
        sp_rank=mesh.get_local_rank("sp"),
        device_type=device_type,
    )
