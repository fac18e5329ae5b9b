"""Checks on the run directory and the checkpoint to resume, made on the driver before Ray starts.

`claim_run_dir` locks `trainer.default_local_dir` for this run, refuses to start a new run on top of
an old one (or moves the old one aside when asked), and turns `trainer.resume_mode` into the one
checkpoint directory the run will load (verified against its checksums) or `disable`. The returned
config says exactly that, so the driver and the workers never look at the marker file again.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Tuple

from ballast.trainer.run.checkpoints import CheckpointError, CheckpointManager, choose_checkpoint, verify_checkpoint
from ballast.trainer.config import BallastConfig
from ballast.trainer.run.run_dir import RunDirLock, check_fresh_start, lock_run_dir


def claim_run_dir(cfg: BallastConfig) -> Tuple[BallastConfig, RunDirLock]:
    """(config with `trainer.resume_mode` resolved to a checkpoint directory or 'disable', the held lock).

    Raises `RunDirError` (directory busy or holding another run) or `CheckpointError` (the checkpoint
    named explicitly fails verification); both name the directory and what to do.
    """
    t = cfg.trainer
    lock = lock_run_dir(t.default_local_dir)
    try:
        moved = check_fresh_start(t.default_local_dir, t.resume_mode, t.resume_from_path, t.move_old_run_aside)
        if moved:
            _say(f"moved the run that was in {t.default_local_dir!r} to {moved!r} (trainer.move_old_run_aside=true)")
        path = resolve_resume(t.default_local_dir, t.resume_mode, t.resume_from_path)
        if path is not None:
            CheckpointManager(t.default_local_dir).warn_if_low_on_space()
    except BaseException:
        lock.release()
        raise
    resolved = dataclasses.replace(t, resume_mode=path or "disable", resume_from_path=None)
    return dataclasses.replace(cfg, trainer=resolved), lock


def resolve_resume(run_dir: str, resume_mode: str, resume_from_path) -> "str | None":
    """The checkpoint directory this run loads, or None for a fresh start (see `choose_checkpoint`)."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        path, warnings = choose_checkpoint(run_dir, verify=True)
        for line in warnings:
            _say(f"warning: {line}")
        return path
    path = os.path.abspath(os.path.expanduser(resume_from_path if resume_mode == "resume_path" else resume_mode))
    problem = verify_checkpoint(path)
    if problem is not None:
        intact, _ = choose_checkpoint(os.path.dirname(path.rstrip(os.sep)), verify=True)
        hint = (f"the newest intact checkpoint beside it is {intact!r} (trainer.resume_from_path={intact})"
                if intact and intact != path else "no intact checkpoint beside it")
        raise CheckpointError(f"cannot resume from {path!r}: {problem}; {hint}, or start over with "
                              "trainer.resume_mode=disable in a new trainer.default_local_dir")
    return path


def _say(line: str) -> None:
    print(f"ballast: {line}", file=sys.stderr, flush=True)
