"""Single controller on Ray: resource pools, worker groups and `@register` dispatch of Batches."""

from ballast.single_controller.decorator import Dispatch, Execute, register
from ballast.single_controller.errors import PlacementError, WorkerDiedError, WorkerError, WorkerTimeoutError
from ballast.single_controller.resource_pool import ResourcePool
from ballast.single_controller.worker import MeshInfo, Worker
from ballast.single_controller.worker_group import BatchFuture, RayWorkerGroup

__all__ = [
    "BatchFuture", "Dispatch", "Execute", "MeshInfo", "PlacementError", "RayWorkerGroup", "ResourcePool", "Worker",
    "WorkerDiedError", "WorkerError", "WorkerTimeoutError", "register",
]
