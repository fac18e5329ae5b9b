"""Data parallelism of one engine: which mode spreads the model over its ranks, and the small
strategy object that `ballast.engine.parallelize.parallelize` returns for it.

Three modes (`DataParallelMode`):

- `fsdp`: FSDP2 shards the parameters, over every rank or, with hybrid sharding, over groups of
  `shard_size` consecutive ranks (each group a replica of the others);
- `ddp`: every rank holds the whole trainable model and `DistributedDataParallel` sums gradients;
- `replica`: every rank holds the whole frozen model (a reference) and nothing is synchronised.

`choose_mode` is the rule and needs no model or process group, so a driver can decide at start-up
how each engine will synchronise. `micro_batch_lockstep` then says whether ranks advance in lockstep
per micro-batch (a collective in every micro-batch: a step waits on the slowest rank of each
micro-batch) or meet only once per mini-batch (a step waits on the slowest rank's total).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel


class DataParallelMode(str, Enum):
    """How an engine's model is spread over its ranks (the value is the name used in reports)."""

    FSDP = "fsdp"
    DDP = "ddp"
    REPLICA = "replica"

    def __str__(self) -> str:
        return self.value


def choose_mode(world_size: int, shard_size: int, cpu_offload: bool, compute_dtype: torch.dtype,
                trainable: bool) -> DataParallelMode:
    """The data-parallel mode of an engine on `world_size` ranks whose parameters are shared by
    `shard_size` ranks (`ballast.engine.dist.resolve_shard_size`).

    Whole replicas (one rank per copy of the parameters, fp32 compute, no CPU offload) need no
    sharding: trainable ones run under DDP, frozen ones as plain modules. A single rank is one such
    replica: FSDP2 over one rank would shard nothing yet still copy and divide every gradient after
    backward (on CPU a fifth of a 135M model's update). Anything else is FSDP2. bf16 compute stays
    on FSDP2 because DDP has no parameter-cast policy, and CPU offload is an FSDP2 policy.
    """
    if world_size < 1 or shard_size < 1:
        raise ValueError(f"world_size={world_size} and shard_size={shard_size} must be >= 1")
    whole_replicas = shard_size == 1 and not cpu_offload and compute_dtype == torch.float32
    if not whole_replicas:
        return DataParallelMode.FSDP
    return DataParallelMode.DDP if trainable else DataParallelMode.REPLICA


def defers_fsdp_reduction(device_type: str) -> bool:
    """Whether FSDP2 accumulates unsharded gradients and reduces them once per mini-batch.

    On CPU (gloo) every collective costs a round trip per layer, so the reduce-scatter runs in the
    last backward of a mini-batch only. On GPU the whole model's unsharded gradients would have to
    fit in memory, so the default (reduce after every backward) stays.
    """
    return device_type == "cpu"


def micro_batch_lockstep(mode: DataParallelMode, device_type: str, reshard_after_forward: bool,
                         backward: bool) -> bool:
    """Whether the DP ranks meet in a collective in every micro-batch of a mini-batch.

    DDP and replicas: no (DDP all-reduces once, in the last backward). FSDP2 with
    `reshard_after_forward`: yes, every forward and backward all-gathers the parameters again.
    Without it the parameters gathered by the first forward stay gathered, so the only collective
    left per micro-batch is the reduce-scatter after each backward, which on CPU is deferred to the
    last one (`defers_fsdp_reduction`). Ulysses all-to-alls stay inside SP groups, whose ranks hold
    the same micro-batches, so they never make DP ranks wait on each other.
    """
    if mode is not DataParallelMode.FSDP:
        return False
    if reshard_after_forward:
        return True
    return backward and not defers_fsdp_reduction(device_type)


@dataclass(frozen=True)
class DataParallel:
    """What `parallelize` returns: the module training forwards go through, its mode, and whether
    gradients are reduced once per mini-batch (`defer_reduction`) rather than after every backward.

    `module` is the model itself under FSDP2 (sharded in place) and for a frozen replica, and a
    `DistributedDataParallel` wrapper around it under DDP. DDP always defers: its summing hook
    all-reduces the accumulated gradient, so reducing after every backward would add the micro-batches
    already reduced once more per rank (for the same reason a DDP mini-batch must start from zero
    gradients). FSDP2 adds each reduce-scatter's result to the sharded gradient, so it may do either
    (`defers_fsdp_reduction`).
    """

    module: torch.nn.Module
    mode: DataParallelMode
    defer_reduction: bool

    def __post_init__(self) -> None:
        expected = {DataParallelMode.FSDP: FSDPModule, DataParallelMode.DDP: DistributedDataParallel,
                    DataParallelMode.REPLICA: torch.nn.Module}[self.mode]
        assert isinstance(self.module, expected), (self.mode, type(self.module))
        if self.mode is DataParallelMode.DDP:
            assert self.defer_reduction, "DDP's summing hook must reduce once per mini-batch"
        if self.mode is DataParallelMode.REPLICA:
            assert not self.defer_reduction, "a frozen replica reduces nothing"

    def gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """The scope of one micro-batch's forward and backward in a mini-batch that back-propagates.

        With `defer_reduction`, gradients accumulate locally in every micro-batch but the `last`,
        whose backward reduces their sum: DDP under `no_sync()`, FSDP2 with gradient sync and
        reshard-after-backward switched off inside the scope and back on when it ends (also when it
        ends by an exception). Otherwise every backward reduces its own gradients.
        """
        if last or not self.defer_reduction:
            return contextlib.nullcontext()
        if self.mode is DataParallelMode.DDP:
            return self.module.no_sync()
        return _fsdp_accumulate_locally(self.module)


@contextlib.contextmanager
def _fsdp_accumulate_locally(root: FSDPModule) -> Iterator[None]:
    # Both setters apply to every FSDP module under the root. Keeping the parameters unsharded after
    # backward spares the next forward its all-gather.
    root.set_requires_gradient_sync(False)
    root.set_reshard_after_backward(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)
        root.set_reshard_after_backward(True)
