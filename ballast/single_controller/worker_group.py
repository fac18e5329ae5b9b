"""`RayWorkerGroup`: N Ray actors of one worker class on a resource pool, driven as one object.

Every method of the worker class marked with `@register` becomes a method of the group that splits
its arguments, calls all workers, waits (with a timeout, noticing dead workers at once) and collects
the results. Non-blocking methods return a `BatchFuture`; passing it to another group whose split
has the same number of chunks hands each worker its chunk's object reference directly, so the data
never returns to the driver in between.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import time
from typing import Any, Dict, List, Optional, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ballast.protocol import Batch
from ballast.single_controller.decorator import Dispatch, Execute, Registration, registration_of
from ballast.single_controller.dispatch import concat_results, mesh_layout, split_args
from ballast.single_controller.errors import WorkerDiedError, WorkerError, WorkerTimeoutError
from ballast.single_controller.resource_pool import ResourcePool
from ballast.single_controller.worker import GENERATION_ENV, LOG_FILE_ENV


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# After one rank raises, how long to look for a peer that died: a rank whose collective partner was
# killed fails with a socket error, and that error must not hide the death that caused it.
PEER_DEATH_GRACE_S = 3.0

# glibc malloc on CPU workers: serve allocations below 4 GiB from the heap and never trim it, so the
# large activation, gradient and logits buffers of one step reuse the memory the previous step freed
# instead of fresh mappings the kernel zero-fills page by page. Measured on SmolLM2-135M with two
# workers (docs/benchmarks.md): median update 12.8 s instead of 15.2 over three interleaved pairs.
# A worker's memory stays at its peak, which the next step needs anyway. The driver's environment wins.
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30),
                  "MALLOC_TOP_PAD_": str(256 << 20)}


def allocator_env(use_gpu: bool, environ: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The malloc settings a worker process starts with: `CPU_MALLOC_ENV` on CPU pools, minus any the
    driver's environment sets itself; nothing on GPU pools (their big buffers live on the device)."""
    environ = os.environ if environ is None else environ
    return {} if use_gpu else {k: v for k, v in CPU_MALLOC_ENV.items() if k not in environ}


class BatchFuture:
    """The pending result of a non-blocking Batch-splitting call.

    `chunk_refs` are the per-dp-rank results in order (None for non-collect workers is never kept);
    `all_refs` include every worker's call so that `get()` also surfaces failures of non-collect ranks.
    """

    def __init__(self, group: "RayWorkerGroup", method: str, chunk_refs: List, all_refs: List, ranks: List[int],
                 pad_count: int) -> None:
        self._group, self._method = group, method
        self.chunk_refs, self._all_refs, self._ranks, self.pad_count = chunk_refs, all_refs, ranks, pad_count

    def check_non_collect(self) -> None:
        """Wait for the ranks whose results are dropped (they return None: nothing is fetched)."""
        side = [(r, rank) for r, rank in zip(self._all_refs, self._ranks) if r not in self.chunk_refs]
        if side:
            self._group._wait([r for r, _ in side], [rank for _, rank in side], self._method)

    def get(self, timeout_s: Optional[float] = None) -> Any:
        """The concatenated results; `timeout_s` replaces the group's timeout for this wait."""
        values = self._group._wait(self._all_refs, self._ranks, self._method, timeout_s)
        by_ref = dict(zip(self._all_refs, values))
        return concat_results([by_ref[r] for r in self.chunk_refs], self.pad_count, f"{self._group.name}.{self._method}")


class RayWorkerGroup:
    def __init__(self, pool: ResourcePool, worker_cls: type, *, init_args: Sequence = (),
                 init_kwargs: Optional[Dict[str, Any]] = None, name: str = "workers", device_share: float = 1.0,
                 env: Optional[Dict[str, str]] = None, num_threads: Optional[int] = None,
                 timeout_s: Optional[float] = None, log_dir: Optional[str] = None) -> None:
        """`log_dir`: each worker appends its stdout and stderr to `<log_dir>/<name>_rank<r>.log` (on
        its own node) instead of Ray's log stream; None leaves the output to Ray."""
        if not 0 < device_share <= 1:
            raise ValueError(f"device_share={device_share} must be in (0, 1]")
        self.name, self.pool, self.worker_cls = name, pool, worker_cls
        self.timeout_s = timeout_s
        self._mesh_cache: Dict[str, tuple] = {}
        self.world_size = len(pool.slots())
        self._init = (tuple(init_args), dict(init_kwargs or {}))
        self._device_share, self._env, self._log_dir = device_share, dict(env or {}), log_dir
        self._threads = num_threads or max(1, int(pool.cpus_per_process * device_share))
        self.generation = 0  # how many times the workers were replaced (`respawn`)
        self.workers: List = []
        self.pids: List[int] = []
        self._spawn()
        self._bind_registered_methods()

    def _spawn(self) -> None:
        """Start one actor per slot of the pool (each in its own placement-group bundle) and tell every
        one the group's rendezvous address."""
        remote_cls = ray.remote(self.worker_cls)
        pool, threads = self.pool, self._threads
        for slot in pool.slots():
            env_vars = {
                # LOCAL_RANK is the slot on the node here; a GPU worker replaces it with its device
                # ordinal at start-up (Worker.__init__), since Ray shows each GPU actor only its own GPU.
                "RANK": str(slot.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(slot.local_rank),
                "BALLAST_NODE_LOCAL_RANK": str(slot.local_rank),
                "LOCAL_WORLD_SIZE": str(len(slot.placement_group.bundle_specs)), "BALLAST_NUM_THREADS": str(threads),
                "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **allocator_env(pool.use_gpu),
                GENERATION_ENV: str(self.generation), **self._env,
            }
            if self._log_dir is not None:
                env_vars[LOG_FILE_ENV] = os.path.join(self._log_dir, f"{self.name}_rank{slot.rank}.log")
            options = dict(
                scheduling_strategy=PlacementGroupSchedulingStrategy(slot.placement_group, slot.bundle_index),
                num_cpus=pool.cpus_per_process * self._device_share, runtime_env={"env_vars": env_vars},
                # a replacement gets a name of its own: the killed actor's may not be released yet
                name=f"{pool.name}_{self.name}_{slot.rank}_{os.getpid()}_{id(self)}_g{self.generation}",
            )
            if pool.use_gpu:
                options["num_gpus"] = self._device_share
            init_args, init_kwargs = self._init
            self.workers.append(remote_cls.options(**options).remote(*init_args, **init_kwargs))
        infos = self._wait([w._ballast_node_info.remote() for w in self.workers], list(range(self.world_size)),
                           "_ballast_node_info")
        self.pids = [info["pid"] for info in infos]
        self.master_addr, self.master_port = infos[0]["ip"], infos[0]["port"]
        self._wait([w._ballast_set_master.remote(self.master_addr, self.master_port) for w in self.workers],
                   list(range(self.world_size)), "_ballast_set_master")

    def respawn(self) -> List[int]:
        """Replace every worker of the group with a fresh process in the same slot, built with the same
        arguments, and return the pids that were ended. The group is one torch.distributed world, so a
        failed or hung member is replaced together with its peers; whatever the workers held (engines,
        weights) is gone, and the caller initialises the new ones (`init_model`, weights) before use."""
        ended = self._end_workers()
        self.generation += 1
        self._mesh_cache.clear()
        self._spawn()
        return ended

    def _end_workers(self) -> List[int]:
        """Kill every worker (a stopped or hung one included: Ray ends its process with SIGKILL) and wait
        until Ray reports each one dead, so that its resources are free for the replacement."""
        pids = list(self.pids)
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # already dead
                pass
        for worker in self.workers:
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                try:
                    ray.get(worker._ballast_node_info.remote(), timeout=1.0)
                except RayActorError:
                    break
                except GetTimeoutError:
                    continue
                time.sleep(0.1)  # killed, not yet reported dead
        self.workers = []
        return pids

    # ------------------------------------------------------------------ method binding
    def _bind_registered_methods(self) -> None:
        for method, fn in inspect.getmembers(self.worker_cls, predicate=inspect.isfunction):
            reg = registration_of(fn)
            if reg is None:
                continue
            if hasattr(self, method):
                raise ValueError(f"{self.worker_cls.__name__}.{method} clashes with a RayWorkerGroup attribute")
            setattr(self, method, functools.partial(self._call, method, reg))

    def _call(self, method: str, reg: Registration, *args, **kwargs):
        what = f"{self.name}.{method}"
        ranks = list(range(self.world_size))
        if reg.dispatch is Dispatch.ONE_TO_ALL:
            if reg.execute is Execute.RANK_ZERO:
                ranks = [0]
            refs = [self.workers[r]._ballast_call.remote(method, True, *args, **kwargs) for r in ranks]
            return self._finish(refs, ranks, method, reg, lambda values: values[0] if reg.execute is Execute.RANK_ZERO else values)
        if reg.dispatch is Dispatch.ALL_TO_ALL:
            for value in list(args) + list(kwargs.values()):
                if not isinstance(value, (list, tuple)) or len(value) != self.world_size:
                    raise ValueError(f"{what}: ALL_TO_ALL arguments must be lists of {self.world_size} (one per worker)")
            refs = [self.workers[r]._ballast_call.remote(method, True, *[a[r] for a in args],
                                                         **{k: v[r] for k, v in kwargs.items()}) for r in ranks]
            return self._finish(refs, ranks, method, reg, list)
        if reg.dispatch is Dispatch.DP_COMPUTE_PROTO:
            dp_of, collect = ranks, ranks
            num_chunks = self.world_size
        else:
            num_chunks, dp_of, collect = self.mesh(reg.mesh)
        per_args, per_kwargs, pad_count = self._split(args, kwargs, num_chunks, reg.pad, what)
        refs = [self.workers[r]._ballast_call.remote(method, r in collect, *per_args[dp_of[r]], **per_kwargs[dp_of[r]])
                for r in ranks]
        chunk_refs = [refs[w] for w in collect]
        future = BatchFuture(self, method, chunk_refs, refs, ranks, pad_count)
        return future.get() if reg.blocking else future

    def submit(self, method: str, *args, **kwargs) -> BatchFuture:
        """Call the Batch-splitting group method `method` without waiting: the calls are submitted now
        (each worker runs its calls in the order they were submitted) and the returned future's
        `get()` waits for them and concatenates the results."""
        reg = registration_of(getattr(self.worker_cls, method, None))
        if reg is None or reg.dispatch not in (Dispatch.DP_COMPUTE_PROTO, Dispatch.MESH):
            raise ValueError(f"{self.name}.{method} is not a Batch-splitting group method; submit() cannot defer it")
        return self._call(method, dataclasses.replace(reg, blocking=False), *args, **kwargs)

    def _split(self, args, kwargs, num_chunks: int, pad: bool, what: str):
        """Split Batch arguments; a BatchFuture with matching chunks is passed through by reference."""
        values = list(args) + list(kwargs.values())
        futures = [v for v in values if isinstance(v, BatchFuture)]
        passthrough = futures and not any(isinstance(v, Batch) for v in values) and all(
            len(f.chunk_refs) == num_chunks and f.pad_count == 0 for f in futures)
        if passthrough:
            # Ray resolves a top-level ObjectRef argument inside the worker: the chunk goes from the
            # producing worker to the consuming one without visiting the driver. A failed producer
            # surfaces as this call's error; the producer's non-collect ranks are checked here.
            for future in futures:
                future.check_non_collect()

            def pick(value, i):
                return value.chunk_refs[i] if isinstance(value, BatchFuture) else value

            return ([[pick(a, i) for a in args] for i in range(num_chunks)],
                    [{k: pick(v, i) for k, v in kwargs.items()} for i in range(num_chunks)], 0)
        args = [v.get() if isinstance(v, BatchFuture) else v for v in args]
        kwargs = {k: (v.get() if isinstance(v, BatchFuture) else v) for k, v in kwargs.items()}
        per_args, per_kwargs, pad_count = split_args(args, kwargs, num_chunks, pad, what)
        # One object-store copy per chunk, shared by every worker of that dp rank (SP/TP peers).
        per_args = [[ray.put(a) if isinstance(a, Batch) else a for a in chunk] for chunk in per_args]
        per_kwargs = [{k: ray.put(v) if isinstance(v, Batch) else v for k, v in chunk.items()} for chunk in per_kwargs]
        return per_args, per_kwargs, pad_count

    def _finish(self, refs, ranks, method, reg: Registration, collect):
        if not reg.blocking:
            return refs
        return collect(self._wait(refs, ranks, method))

    def mesh(self, role: str):
        """(dp_size, dp rank of each worker, collect worker of each dp rank) for `role`, cached."""
        if role not in self._mesh_cache:
            infos = self._wait([w._ballast_mesh_info.remote(role) for w in self.workers],
                               list(range(self.world_size)), f"mesh info for {role!r}")
            self._mesh_cache[role] = mesh_layout(infos, role)
        return self._mesh_cache[role]

    # ------------------------------------------------------------------ waiting and errors
    def _wait(self, refs: List, ranks: List[int], method: str, timeout_s: Optional[float] = None) -> List[Any]:
        """Results of `refs` in order; the first failure, death or timeout (`timeout_s`, else the group's)
        raises at once, naming the rank."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        index_of = {ref: i for i, ref in enumerate(refs)}
        results: List[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                late = sorted(ranks[index_of[r]] for r in pending)
                raise WorkerTimeoutError(
                    f"{self.name}.{method}: worker rank(s) {late} did not finish within {timeout_s:.0f}s "
                    "(raise trainer.worker_timeout_s if the step is legitimately slow)"
                )
            ref = ready[0]
            rank = ranks[index_of[ref]]
            try:
                results[index_of[ref]] = ray.get(ref)
            except RayActorError as err:
                raise WorkerDiedError(
                    f"{self.name}.{method}: worker rank {rank} died ({type(err).__name__}): {err}"
                ) from None
            except RayTaskError as err:
                detail = _ANSI.sub("", str(err))
                died = self._dead_peer(pending, ranks, index_of, method, deadline)
                if died is not None:
                    last = detail.strip().splitlines()[-1] if detail.strip() else type(err).__name__
                    raise WorkerDiedError(f"{died} (worker rank {rank} then failed: {last})") from None
                raise WorkerError(f"{self.name}.{method} failed on worker rank {rank}:\n{detail}") from None
            except GetTimeoutError:  # pragma: no cover - ray.wait said it was ready
                raise WorkerTimeoutError(f"{self.name}.{method}: worker rank {rank} timed out") from None
        return results

    def _dead_peer(self, pending: List, ranks: List[int], index_of: Dict, method: str,
                   deadline: Optional[float]) -> Optional[str]:
        """The death message of a still-pending call whose worker died within the grace period, or None."""
        grace = PEER_DEATH_GRACE_S if deadline is None else min(PEER_DEATH_GRACE_S, deadline - time.monotonic())
        if not pending or grace <= 0:
            return None
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=grace)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                return f"{self.name}.{method}: worker rank {ranks[index_of[ref]]} died ({type(err).__name__}): {first}"
            except Exception:  # another ordinary failure: the first one is reported
                continue
        return None

    def placement(self) -> List[Dict[str, Any]]:
        """Where each worker runs, in rank order: `ip`, `pid`, `node_id`, its torch `threads` (and a free
        `port` on its node)."""
        return self.execute_all("_ballast_node_info")

    def ping(self, timeout_s: float) -> List[Dict[str, Any]]:
        """Every worker's `placement()` entry, or WorkerDiedError / WorkerTimeoutError naming the first
        worker that is gone or does not answer within `timeout_s` (a health check)."""
        return self._wait([w._ballast_node_info.remote() for w in self.workers], list(range(self.world_size)),
                          "ping", timeout_s)

    def execute_all(self, method: str, *args, **kwargs) -> List[Any]:
        """Call an unregistered worker method on every worker with the same arguments."""
        refs = [w._ballast_call.remote(method, True, *args, **kwargs) for w in self.workers]
        return self._wait(refs, list(range(self.world_size)), method)

    def kill(self) -> None:
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # already dead: nothing to stop
                pass
        self.workers = []
