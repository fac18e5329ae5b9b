"""Errors the driver raises when a worker call fails, dies or does not answer in time."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker method raised. The message names the group, rank and method and holds the remote traceback."""


class WorkerDiedError(WorkerError):
    """A worker process is gone (killed, OOM, crashed); its peers may be stuck in a collective."""


class WorkerTimeoutError(WorkerError):
    """A worker call did not finish within the configured timeout."""


class PlacementError(RuntimeError):
    """The cluster could not place a resource pool's bundles in time (too few nodes, CPUs or GPUs)."""
