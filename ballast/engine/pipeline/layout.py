"""The (dp, pp) mesh of a pipeline engine: who is which stage of which replica, and the groups.

Ranks are laid out row-major on a (dp, pp) mesh, ``rank = dp_rank * pp + pp_rank``: the ``pp``
ranks of one pipeline are consecutive and hold the same rows (like SP peers); the DP group of a
rank is the ranks with the same ``pp_rank`` (the replicas of its stages, whole: their gradients are
summed by one all-reduce per mini-batch). The tied group joins, over every replica, the ranks that
hold the first and the last stage, whose copies of a tied vocabulary matrix get one gradient.

The state answers what the workers and helpers ask an engine's parallel state (``dp_rank``,
``dp_size``, ``sp_size`` = 1, ``device``, ...); the last pipeline rank answers for its replica
(``collects``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ballast.engine.dist import device_of


@dataclass
class PipelineParallelState:
    mesh: DeviceMesh  # 2-D, dim names ("dp", "pp")
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    tied_group: dist.ProcessGroup | None  # None on ranks holding neither end of their pipeline
    dp_size: int
    pp_size: int
    dp_rank: int
    pp_rank: int
    device_type: str

    sp_size = 1
    sp_rank = 0

    @property
    def world_size(self) -> int:
        return self.dp_size * self.pp_size

    @property
    def collects(self) -> bool:
        """Whether this rank answers for its pipeline: the last stage's, where the losses run (what a
        loss records there, e.g. the log-probs an update trained with, exists on that rank only)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def last_rank(self) -> int:
        """Global rank of this pipeline's last stage (where losses and outputs are computed)."""
        return self.dp_rank * self.pp_size + self.pp_size - 1

    @property
    def device(self) -> torch.device:
        return device_of(self.device_type)


def build_pipeline_state(pp_size: int, device_type: str) -> PipelineParallelState:
    """The (dp, pp) mesh over the default process group. Collective (creates groups)."""
    if not dist.is_initialized():
        raise RuntimeError("call init_distributed() (or torch.distributed.init_process_group) first")
    world = dist.get_world_size()
    if pp_size < 2 or world % pp_size:
        raise ValueError(f"world size {world} is not divisible by pipeline_model_parallel_size={pp_size}")
    dp_size = world // pp_size
    mesh = init_device_mesh(device_type, (dp_size, pp_size), mesh_dim_names=("dp", "pp"))
    ends = sorted({d * pp_size + k for d in range(dp_size) for k in (0, pp_size - 1)})
    tied = dist.new_group(ends)  # every rank calls new_group, members or not
    rank = dist.get_rank()
    return PipelineParallelState(
        mesh=mesh, dp_group=mesh["dp"].get_group(), pp_group=mesh["pp"].get_group(),
        tied_group=tied if rank in ends else None, dp_size=dp_size, pp_size=pp_size,
        dp_rank=mesh.get_local_rank("dp"), pp_rank=mesh.get_local_rank("pp"), device_type=device_type,
    )
