"""Finding what a Ray session left running, from the outside: every process with a file open, its
working directory or its command line under the session directory. Broader than what Ballast itself
ends (`ballast.trainer.run.ray_watchdog` ends only processes carrying the session's mark), which is
what a leftover check wants: a Ray process that lost its mark would show up here."""

import os
from typing import Iterable, List


def _under(path: str, root: str) -> bool:
    path = path.removesuffix(" (deleted)")  # a file the cleanup already removed, still open
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
    skip = {str(os.getpid()), *map(str, exclude)}
    return sorted(int(pid) for pid in os.listdir("/proc") if pid.isdigit() and pid not in skip and _uses(pid, root))
