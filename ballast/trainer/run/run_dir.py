"""One run per run directory: an OS-level lock for the life of a run, and no fresh start on top of an old run.

Two runs writing into the same `trainer.default_local_dir` interleave `metrics.jsonl`, overwrite each
other's `config.json` and checkpoints, and a later `resume_mode=auto` may pick up the other run's
checkpoint. `lock_run_dir` takes an exclusive `flock` on `<dir>/.ballast.lock`; the kernel drops it
when the process ends however it ends (kill -9 included), so a crashed run never leaves a stale lock.
The holder's pid, host and start time are written into the lock file so that the refused run can say
who holds it.

`check_fresh_start` refuses to start a new run (`resume_mode=disable`, `auto` without a complete
checkpoint to continue from, or resuming from a checkpoint outside the directory) in a directory that
already holds a run, unless `trainer.move_old_run_aside` asks to move the old run to a sibling
directory first.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from typing import List, Optional

LOCK_FILE = ".ballast.lock"
# What a run leaves in its directory; any of these means "a run lives here".
RUN_MARKERS = ("metrics.jsonl", "config.json", "workers.json", "latest_checkpointed_iteration.txt")


class RunDirError(ValueError):
    """The run directory is in use by another run, or holds a run this one would overwrite."""


class RunDirLock:
    """An exclusive lock on a run directory; released by `release()` or when the process exits."""

    def __init__(self, run_dir: str, fd: int) -> None:
        self.run_dir, self._fd = run_dir, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def lock_run_dir(run_dir: str) -> RunDirLock:
    """Lock `run_dir` (created if needed) for this process, or raise `RunDirError` naming the holder,
    or naming why the directory cannot hold a run (a file, a path under a file, not writable)."""
    try:
        if os.path.exists(run_dir) and not os.path.isdir(run_dir):
            raise NotADirectoryError("it is a file, not a directory")
        os.makedirs(run_dir, exist_ok=True)
        fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        where = f" ({err.filename})" if isinstance(err, OSError) and err.filename else ""
        raise RunDirError(f"trainer.default_local_dir={run_dir!r} cannot hold a run: {reason}{where}; point "
                          "trainer.default_local_dir at a writable directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(run_dir, fd) from None
    os.ftruncate(fd, 0)
    info = f"pid {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    os.pwrite(fd, info.encode(), 0)
    return RunDirLock(run_dir, fd)


def check_not_busy(run_dir: str) -> None:
    """Raise the `RunDirError` of `lock_run_dir` if another process holds `run_dir`'s lock; creates
    nothing (a directory without a lock file is not busy)."""
    try:
        fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CLOEXEC)
    except (OSError, ValueError):
        return  # no lock file, or a path lock_run_dir will refuse with its own reason
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(run_dir, fd) from None
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _busy(run_dir: str, fd: int) -> RunDirError:
    """The error for a directory whose lock `fd` another process holds; closes `fd`."""
    holder = _read_holder(fd)
    os.close(fd)
    return RunDirError(f"trainer.default_local_dir={run_dir!r} is in use by another run ({holder}); wait for it "
                       "to end, or give this run another trainer.default_local_dir")


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown: it has not written its pid yet"


def run_contents(run_dir: str) -> List[str]:
    """The entries of `run_dir` that show a run lives there (sorted); empty for a new directory."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in sorted(os.listdir(run_dir)):
        if name in RUN_MARKERS or (name.startswith("global_step_") and os.path.isdir(os.path.join(run_dir, name))):
            found.append(name)
    return found


def starts_fresh_here(continues_from: Optional[str], run_dir: str) -> bool:
    """Whether a run that loads checkpoint `continues_from` (None: none) starts a history of its own in
    `run_dir`, rather than continuing the run the directory holds."""
    if continues_from is None:
        return True
    source = os.path.abspath(os.path.expanduser(continues_from))
    return os.path.dirname(source.rstrip(os.sep)) != os.path.abspath(run_dir).rstrip(os.sep)


def check_fresh_start(run_dir: str, resume_mode: str, continues_from: Optional[str],
                      move_old_run_aside: bool) -> Optional[str]:
    """Refuse a fresh start on top of an existing run, or move that run aside when asked.

    `continues_from` is the checkpoint the run will load (None: none), `resume_mode` what the user
    wrote (for the message). Returns the directory the old run was moved to, or None when nothing was
    moved. Call it while holding the run directory's lock.
    """
    if not starts_fresh_here(continues_from, run_dir):
        return None
    found = run_contents(run_dir)
    if not found:
        return None
    if not move_old_run_aside:
        shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")
        auto = resume_mode == "auto"  # it found nothing to continue from
        raise RunDirError(
            f"trainer.default_local_dir={run_dir!r} already holds a run ({shown})"
            f"{' but no complete checkpoint to continue it from,' if auto else ''} and "
            f"trainer.resume_mode={resume_mode!r} would start a new one on top of it; use a new "
            f"trainer.default_local_dir, {'' if auto else 'continue the old run with trainer.resume_mode=auto, '}"
            "or set trainer.move_old_run_aside=true to move the old run to a sibling directory first"
        )
    return move_run_aside(run_dir)


def move_run_aside(run_dir: str) -> str:
    """Move everything in `run_dir` except the lock file into `<run_dir>.old-<time>`; returns that path."""
    base = os.path.abspath(run_dir).rstrip(os.sep) + ".old-" + time.strftime("%Y%m%d-%H%M%S")
    target, n = base, 1
    while os.path.exists(target):
        n += 1
        target = f"{base}-{n}"
    os.makedirs(target)
    for name in os.listdir(run_dir):
        if name != LOCK_FILE:
            os.rename(os.path.join(run_dir, name), os.path.join(target, name))
    return target
