"""The Ray instance a run uses: a cluster it joins (`ray_init.address`), or a local instance it starts
and owns, closed to everyone else, of which nothing may outlive the run.

A local instance keeps its logs and sockets in `<RAY_TMPDIR or /tmp>/ray_<random>` (Ray's own
`RAY_TMPDIR` variable chooses the parent, as it does for Ray's default directory), a directory of
mode 0700 that also holds the session's token. It listens on 127.0.0.1 only, with token
authentication, and its processes (so the workers) start with only the environment they need
(`ballast.trainer.run.ray_env`). The run owns that directory and every process that carries the
session's mark: `RaySession.stop()` shuts Ray down, stops whichever of its processes are still
running (Ray's agents can outlive `ray.shutdown()`), removes the directory and releases the watchdog;
`kill_now()` does the same at once, for the shutdown's hard deadline; and the watchdog
(`ballast.trainer.run.ray_watchdog`, a separate process started before Ray) does it when the driver
is killed. A local Ray that fails to start (Ray gives a raylet 30 s to register, which a loaded
machine can miss) is a `RayUnavailableError`, with its processes stopped and its directory removed.
A cluster's session directory and processes are never touched.
"""

from __future__ import annotations

import contextlib
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
from typing import Dict, List, Optional, Sequence, Tuple

from ballast.trainer.run import ray_env, ray_watchdog
from ballast.trainer.config import BallastConfig, ConfigError
from ballast.trainer.config.derived import rollout_world_size
from ballast.trainer.config.off_policy import split_pools


class RayUnavailableError(RuntimeError):
    """Nothing answered at `ray_init.address` within `ray_init.timeout_s`, or a local Ray did not start."""


@dataclasses.dataclass
class RaySession:
    """What `start_ray` set up. `connected`: this run initialised Ray (a cluster connection or a local
    instance) and shuts it down; `temp_dir`/`watchdog`/`session_id`: a local instance's directory, its
    watchdog and the mark its processes carry; `restore`: the driver's variables as they were before
    the local session set its own (put back by `stop`)."""

    connected: bool
    temp_dir: Optional[str] = None
    watchdog: Optional[subprocess.Popen] = None
    session_id: str = ""
    restore: Dict[str, Optional[str]] = dataclasses.field(default_factory=dict)
    was_single_machine: bool = False

    def stop(self) -> None:
        """Shut Ray down; for a local instance also stop what is left of it and remove its directory."""
        import ray

        try:
            if self.connected:
                ray.shutdown()
        finally:
            _restore_signal_handlers()
            self._clear(grace_s=3.0)
            self._restore_environ()

    def kill_now(self) -> None:
        """Kill a local instance's processes and remove its directory at once (another thread may still
        be inside `ray.shutdown`); for a cluster nothing: its GCS ends the job's actors with the driver."""
        self._clear(grace_s=0.0)

    def processes(self) -> List[int]:
        """The pids of the local instance's processes still running (none for a cluster)."""
        exclude = [self.watchdog.pid] if self.watchdog is not None else []
        return ray_watchdog.session_processes(self.session_id, exclude)

    def _clear(self, grace_s: float) -> None:
        if self.temp_dir:
            ray_watchdog.end_processes(self.processes(), grace_s)
            ray_watchdog.remove_session_dir(self.temp_dir)
        if self.watchdog is not None:
            _release(self.watchdog)
            self.watchdog = None

    def _restore_environ(self) -> None:
        if self.restore:
            ray_env.apply(self.restore)
            ray_env.set_single_machine(self.was_single_machine)
            self.restore = {}
            ray_env.reload_ray_auth()


def _keep_ray_off_the_drivers_signals() -> None:
    """Stop `ray.init` from installing its C++ handlers for fatal signals in this process (the driver).

    Ray's core worker installs them at `ray.init`, SIGTERM among them (a stack dump and exit 134 for
    what is a scheduler's polite request), and `ray.shutdown()` resets them all to the default action
    behind Python's back before it spends about a second stopping the local processes: a SIGTERM in
    that second kills the driver in the middle of its cleanup, without its exit code or last line.
    Ray's own switch for this is `RAY_DISABLE_FAILURE_SIGNAL_HANDLER`, read when Ray is imported; the
    module attribute it sets is set here instead, so that the workers (which would inherit the variable)
    keep their crash stack dumps. Python's faulthandler still reports a crash here.
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

    A local instance is closed (see the module docstring); a cluster keeps its own authentication.
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
    r, t = cfg.ray_init, cfg.trainer
    processes = t.nnodes * t.n_gpus_per_node
    if split_pools(cfg):  # the rollout pool's processes come on top
        processes += rollout_world_size(cfg)
    num_cpus, warning = local_num_cpus(processes, t.cpus_per_worker, os.cpu_count() or 1, r.num_cpus)
    if warning:
        print(f"ballast: {warning}", flush=True)
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        print(f"ballast: RAY_AUTH_MODE={os.environ['RAY_AUTH_MODE']} applies to clusters (ray_init.address) only: "
              "the local Ray instance always uses token authentication, with a token of its own", flush=True)
    return open_local_ray(r.worker_env_vars, num_cpus=num_cpus, include_dashboard=False,
                          dashboard_host=r.dashboard_host, **quiet)


def open_local_ray(worker_env_vars: Sequence[str] = (), **ray_kwargs) -> RaySession:
    """Start a fresh local Ray instance, closed (see the module docstring), with `ray_kwargs` for
    `ray.init`; `worker_env_vars`: the driver's variables its processes inherit beyond the defaults."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="ray_", dir=ray_temp_root())
    session_id = ray_env.new_session_id()
    session = RaySession(connected=True, temp_dir=temp_dir, session_id=session_id,
                         watchdog=_start_watchdog(temp_dir, session_id))
    print(f"ballast: local Ray session in {temp_dir} (removed at exit)", flush=True)
    try:
        token = ray_env.write_token(temp_dir)
        processes_env = ray_env.ray_process_env(os.environ, worker_env_vars, session_id, token)
        session.restore = ray_env.apply(ray_env.driver_vars(token))
        session.was_single_machine = ray_env.set_single_machine(True)
        ray_env.reload_ray_auth()
        with _environ(processes_env):  # what Ray's processes, and the workers through the raylet, start with
            # address="local": always a fresh instance, even when RAY_ADDRESS is set by a parent process.
            ray.init(address="local", _temp_dir=os.path.join(temp_dir, ray_env.RAY_DIR), **ray_kwargs)
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


@contextlib.contextmanager
def _environ(env: Dict[str, str]):
    """This process's environment is exactly `env` inside the block (the processes it starts inherit
    that), and what it was outside."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _start_watchdog(temp_dir: str, session_id: str) -> Optional[subprocess.Popen]:
    """The watchdog process for a local session (see `ballast.trainer.run.ray_watchdog`); None off Linux."""
    if not os.path.isdir("/proc"):
        return None
    return subprocess.Popen([sys.executable, "-I", os.path.abspath(ray_watchdog.__file__), temp_dir, session_id],
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
