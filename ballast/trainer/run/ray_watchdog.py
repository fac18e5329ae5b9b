"""Leave nothing of a local Ray instance behind, even when the driver that started it is killed, and
end nothing that is not the run's.

A process is taken to be the run's only when it carries the session's mark: the driver starts its
local Ray with `BALLAST_RAY_SESSION=<session id>` in the environment (`ballast.trainer.run.ray_env`),
and every process of the session (GCS, raylet, the dashboard and runtime-env agents, log monitor,
workers, whatever the workers start with their environment) inherits it. `/proc/<pid>/environ` holds
the environment a process was started with; Ray's processes that rename themselves
(`ray::DashboardAgent`) would write the new name over it, which `SPT_NOENV=1` (also set for the
session) prevents. Being under the session directory proves nothing: a user's `tail -f` of a Ray log,
a `du` of the directory or a shell whose working directory it is name the path too, and they are
never touched. `session_processes(id)` finds the marked processes (Linux `/proc`; elsewhere none),
`end_processes` stops them: SIGTERM, then SIGKILL after a grace period.

Run as a script (`python -I ray_watchdog.py <session dir> <session id>`, standard library only, so
it starts in milliseconds and imports nothing of the driver's), this module is the watchdog a run
starts next to its local Ray: it waits on a pipe from the driver. `done` on the pipe means the driver
cleaned up itself; end-of-file without it means the driver died (`kill -9`, the kernel's OOM killer),
and the watchdog then stops the session's processes and removes the directory. Without it, Ray's
agents outlive a killed driver by about a minute (they notice a dead raylet only when their GCS calls
time out). The watchdog ignores SIGINT, SIGTERM and SIGHUP (a Ctrl-C in the terminal or a scheduler's
SIGTERM to the whole job reaches it too) and so ends only once the driver has.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from typing import Iterable, List

DONE = b"done"
MARK = "BALLAST_RAY_SESSION"
"""The environment variable whose value names the local Ray session a process belongs to."""


def mark_entry(session_id: str) -> bytes:
    """The `NAME=value` entry of the session's mark, as it appears in `/proc/<pid>/environ`."""
    return f"{MARK}={session_id}".encode()


def carries_mark(pid: int, entry: bytes) -> bool:
    """Whether process `pid` started with `entry` in its environment (False when gone or unreadable:
    another user's process is not readable, and so never the run's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        return False


def session_processes(session_id: str, exclude: Iterable[int] = ()) -> List[int]:
    """Pids of the processes (other than this one and `exclude`) that carry session `session_id`'s mark."""
    if not session_id or not os.path.isdir("/proc"):
        return []
    entry = mark_entry(session_id)
    skip = {os.getpid(), *exclude}
    pids = (int(name) for name in os.listdir("/proc") if name.isdigit())
    return sorted(pid for pid in pids if pid not in skip and carries_mark(pid, entry))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"  # a zombie has ended; its parent reaps it
    except (OSError, IndexError):
        return False


def end_processes(pids: Iterable[int], grace_s: float = 3.0) -> List[int]:
    """SIGTERM `pids`, SIGKILL those still alive after `grace_s`; returns the pids that were alive."""
    alive = [pid for pid in pids if _alive(pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while any(_alive(pid) for pid in alive) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not any(_alive(pid) for pid in alive):
            break
    return alive


def remove_session_dir(root: str) -> None:
    """Remove a local Ray session directory made by Ballast (`ray_*`), never anything else."""
    if root and os.path.basename(root.rstrip(os.sep)).startswith("ray_"):
        shutil.rmtree(root, ignore_errors=True)


def main(argv: List[str]) -> int:
    root, session_id = argv[1], argv[2]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    message = sys.stdin.buffer.read()  # until the driver writes `done` and closes, or dies
    if message.startswith(DONE):
        return 0
    left = end_processes(session_processes(session_id))
    remove_session_dir(root)
    sys.stderr.write(f"ballast: watchdog: the driver ended without stopping its local Ray; stopped "
                     f"{len(left)} Ray process(es) and removed {root}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
