"""Leave nothing of a local Ray instance behind, even when the driver that started it is killed.

Every process of a local Ray session (GCS, raylet, the dashboard and runtime-env agents, log monitor,
workers) keeps files open under the session's temporary directory, while several of them rename
themselves (`ray::DashboardAgent`) so that their command line no longer says which session they serve.
`processes_using(dir)` finds them by their open files, working directory and command line (Linux
`/proc`; elsewhere it finds nothing), and `end_processes` stops them: SIGTERM, then SIGKILL after a
grace period.

Run as a script (`python -I ray_watchdog.py <session dir>`, standard library only, so it starts in
milliseconds and imports nothing of the driver's), this module is the watchdog a run starts next to
its local Ray: it waits on a pipe from the driver. `done` on the pipe means the driver cleaned up
itself; end-of-file without it means the driver died (`kill -9`, the kernel's OOM killer), and the
watchdog then stops the session's processes and removes the directory. Without it, Ray's agents
outlive a killed driver by about a minute (they notice a dead raylet only when their GCS calls time
out). The watchdog ignores SIGINT, SIGTERM and SIGHUP (a Ctrl-C in the terminal or a scheduler's
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


def _under(path: str, root: str) -> bool:
    path = path.removesuffix(" (deleted)")  # a file the driver's cleanup already removed, still open
    return path == root or path.startswith(root + os.sep)


def _uses(pid: str, root: str) -> bool:
    base = f"/proc/{pid}"
    try:
        if _under(os.readlink(f"{base}/cwd"), root):
            return True
        with open(f"{base}/cmdline", "rb") as f:
            if root.encode() in f.read():
                return True
        for fd in os.listdir(f"{base}/fd"):
            try:
                if _under(os.readlink(f"{base}/fd/{fd}"), root):
                    return True
            except OSError:
                continue
    except OSError:  # gone, or not ours to inspect
        return False
    return False


def processes_using(root: str, exclude: Iterable[int] = ()) -> List[int]:
    """Pids of the processes (other than this one and `exclude`) with a file open, their working
    directory or their command line under `root`."""
    root = os.path.abspath(root).rstrip(os.sep)
    if not os.path.isdir("/proc"):
        return []
    skip = {str(os.getpid()), *map(str, exclude)}
    return sorted(int(pid) for pid in os.listdir("/proc") if pid.isdigit() and pid not in skip and _uses(pid, root))


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
    root = argv[1]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    message = sys.stdin.buffer.read()  # until the driver writes `done` and closes, or dies
    if message.startswith(DONE):
        return 0
    left = end_processes(processes_using(root))
    remove_session_dir(root)
    sys.stderr.write(f"ballast: watchdog: the driver ended without stopping its local Ray; stopped "
                     f"{len(left)} Ray process(es) and removed {root}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
