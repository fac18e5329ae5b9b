"""The Ray instance a run uses: a cluster it joins (`ray_init.address`), or a local instance it starts
and owns, of which nothing may outlive the run.

A local instance keeps its logs and sockets in `<RAY_TMPDIR or /tmp>/ray_<random>` (Ray's own
`RAY_TMPDIR` variable chooses the parent, as it does for Ray's default directory). The run owns that
directory and every process that uses it: `RaySession.stop()` shuts Ray down, stops whichever of its
processes are still running (Ray's agents can outlive `ray.shutdown()`), removes the directory and
releases the watchdog; `kill_now()` does the same at once, for the shutdown's hard deadline; and the
watchdog (`ballast.trainer.run.ray_watchdog`, a separate process started before Ray) does it when the
driver is killed. A local Ray that fails to start (Ray gives a raylet 30 s to register, which a loaded
machine can miss) is a `RayUnavailableError`, with its processes stopped and its directory removed.
A cluster's session directory and processes are never touched.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Tuple

from ballast.trainer.run import ray_watchdog
from ballast.trainer.config import BallastConfig, ConfigError
from ballast.trainer.config.derived import rollout_world_size
from ballast.trainer.config.off_policy import split_pools


class RayUnavailableError(RuntimeError):
    """Nothing answered at `ray_init.address` within `ray_init.timeout_s`, or a local Ray did not start."""


@dataclasses.dataclass
class RaySession:
    """What `start_ray` set up. `connected`: this run initialised Ray (a cluster connection or a local
    instance) and shuts it down; `temp_dir`/`watchdog`: a local instance's directory and its watchdog."""

    connected: bool
    temp_dir: Optional[str] = None
    watchdog: Optional[subprocess.Popen] = None

    def stop(self) -> None:
        """Shut Ray down; for a local instance also stop what is left of it and remove its directory."""
        import ray

        try:
            if self.connected:
                ray.shutdown()
        finally:
            _restore_signal_handlers()
            self._clear(grace_s=3.0)

    def kill_now(self) -> None:
        """Kill a local instance's processes and remove its directory at once (another thread may still
        be inside `ray.shutdown`); for a cluster nothing: its GCS ends the job's actors with the driver."""
        self._clear(grace_s=0.0)

    def _clear(self, grace_s: float) -> None:
        if self.temp_dir:
            exclude = [self.watchdog.pid] if self.watchdog is not None else []
            ray_watchdog.end_processes(ray_watchdog.processes_using(self.temp_dir, exclude), grace_s)
            ray_watchdog.remove_session_dir(self.temp_dir)
        if self.watchdog is not None:
            _release(self.watchdog)
            self.watchdog = None


def _keep_ray_off_the_drivers_signals() -> None:
    """Stop `ray.init` from installing its C++ handlers for fatal signals in this process (the driver).

    Ray's core worker installs them at `ray.init`, SIGTERM among them (a stack dump and exit 134 for
    what is a scheduler's polite request), and `ray.shutdown()` resets them all to the default action
    behind Python's back before it spends about a second stopping the local processes: a SIGTERM in
    that second kills the driver in the middle of its cleanup, without its exit code or last line.
    Ray's own switch for this is `RAY_DISABLE_FAILURE_SIGNAL_HANDLER`, read when Ray is imported; the
    module attribute it sets is set here instead, so that the workers (which inherit the driver's
    environment) keep their crash stack dumps. Python's faulthandler still reports a crash here.
    """
    try:
        from ray._private import ray_constants
    except ImportError:
        return
    if hasattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"):
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


def _restore_signal_handlers() -> None:
    """Make the process's SIGINT and SIGTERM actions what Python believes they are again (a fallback
    for a Ray whose switch above went away: its `ray.shutdown()` resets them)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if handler is not None:
            signal.signal(signum, handler)


def ray_temp_root() -> str:
    """Where local Ray session directories go: `$RAY_TMPDIR` when set (Ray's own variable), else /tmp
    (short: Ray's socket paths in it must stay under the 107-byte limit of a Unix socket)."""
    return os.environ.get("RAY_TMPDIR") or "/tmp"


def start_ray(cfg: BallastConfig) -> RaySession:
    """Connect to `ray_init.address` or start a local instance (see the module docstring).

    Ray's own token authentication is left on (Ray's default for a new local instance): a local
    Ray's gRPC ports listen on every interface, and without the token anyone who can reach them can
    run code. Tests and the quickstart opt out with RAY_AUTH_MODE=disabled.
    """
    import ray

    from ballast.trainer.run.tracking import verbose_output

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Worker output goes to the run directory's log files unless BALLAST_VERBOSE asks for it here.
    quiet = dict(log_to_driver=verbose_output(), logging_level=logging.INFO if verbose_output() else logging.WARNING)
    r = cfg.ray_init
    if r.address:
        probe_ray_address(r.address, r.timeout_s)
    if ray.is_initialized():
        return RaySession(connected=False)
    _keep_ray_off_the_drivers_signals()
    if r.address:
        try:
            ray.init(address=r.address, **quiet)
        except Exception as err:
            raise RayUnavailableError(f"ray_init.address={r.address!r}: connecting failed: {_first_line(err)}") from err
        return RaySession(connected=True)
    return _start_local(cfg, quiet)


def local_num_cpus(processes: int, cpus_per_worker: int, cores: int, num_cpus: Optional[int]) -> Tuple[int, str]:
    """(CPUs a local Ray instance gets, a warning or ""). `ray_init.num_cpus` wins; otherwise every
    worker's `cpus_per_worker` must fit, and more processes than cores still start (the tests run 4
    workers on 2 cores), but threads beyond the cores only slow each other down: that is said."""
    if num_cpus:
        return num_cpus, ""
    wanted = processes * cpus_per_worker
    warning = ""
    if wanted > cores and cpus_per_worker > 1:
        warning = (f"{processes} worker(s) x trainer.cpus_per_worker={cpus_per_worker} = {wanted} threads on {cores} "
                   "cores: oversubscribed (lower trainer.cpus_per_worker or trainer.n_gpus_per_node)")
    return max(cores, wanted), warning


def _start_local(cfg: BallastConfig, quiet: dict) -> RaySession:
    import ray

    r, t = cfg.ray_init, cfg.trainer
    processes = t.nnodes * t.n_gpus_per_node
    if split_pools(cfg):  # the rollout pool's processes come on top
        processes += rollout_world_size(cfg)
    num_cpus, warning = local_num_cpus(processes, t.cpus_per_worker, os.cpu_count() or 1, r.num_cpus)
    if warning:
        print(f"ballast: {warning}", flush=True)
    temp_dir = tempfile.mkdtemp(prefix="ray_", dir=ray_temp_root())
    session = RaySession(connected=True, temp_dir=temp_dir, watchdog=_start_watchdog(temp_dir))
    print(f"ballast: local Ray session in {temp_dir} (removed at exit)", flush=True)
    try:
        # address="local": always a fresh instance, even when RAY_ADDRESS is set by a parent process.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, dashboard_host=r.dashboard_host,
                 _temp_dir=temp_dir, **quiet)
    except BaseException as err:
        try:
            session.stop()  # ray.shutdown() also resets a half-initialised Ray
        except Exception:
            session.kill_now()
        if not isinstance(err, Exception):  # Ctrl-C, SIGTERM
            raise
        raise RayUnavailableError(
            f"the local Ray instance did not start: {_first_line(err)} (its processes were stopped and {temp_dir} "
            "removed; a heavily loaded machine can miss Ray's start-up limit: retry when the load is lower)"
        ) from err
    return session


def _start_watchdog(temp_dir: str) -> Optional[subprocess.Popen]:
    """The watchdog process for a local session (see `ballast.trainer.run.ray_watchdog`); None off Linux."""
    if not os.path.isdir("/proc"):
        return None
    return subprocess.Popen([sys.executable, "-I", os.path.abspath(ray_watchdog.__file__), temp_dir],
                            stdin=subprocess.PIPE, close_fds=True)


def _release(watchdog: subprocess.Popen) -> None:
    try:
        watchdog.stdin.write(ray_watchdog.DONE)
        watchdog.stdin.close()
        watchdog.wait(timeout=5)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        watchdog.kill()
        watchdog.wait()


def _first_line(err: BaseException) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


def _host_port(address: str) -> Tuple[str, int]:
    target = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"ray_init.address={address!r} must be 'auto', host:port or ray://host:port")
    return host.strip("[]"), int(port)


def probe_ray_address(address: str, timeout_s: float) -> None:
    """Fail within `timeout_s`, naming the address, when nothing listens there.

    `ray.init(address=...)` on an address where nothing answers keeps retrying for minutes; a TCP
    connect to the GCS port tells the same thing in milliseconds (or after `timeout_s` when a
    firewall drops the packets).
    """
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "")
        if not address:
            return  # Ray resolves "auto" from this machine's session file and fails at once if there is none
    host, port = _host_port(address)
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(remaining, 5.0))):
                return
        except OSError as err:
            if time.monotonic() + 0.5 >= deadline:
                raise RayUnavailableError(
                    f"ray_init.address={address!r}: nothing answered at {host}:{port} within {timeout_s:g}s "
                    f"(ray_init.timeout_s) ({err.strerror or type(err).__name__}); start the head with "
                    "scripts/ray_cluster.sh head, or fix the address"
                ) from None
            time.sleep(0.5)
