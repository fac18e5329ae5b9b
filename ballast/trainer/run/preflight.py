"""Checks on the run directory and the checkpoint to resume, made on the driver before Ray starts.

`resume_point` turns `trainer.resume_mode` (kept as the user wrote it) into one typed `ResumePoint`:
the checkpoint directory the run will load, verified against its checksums, or a fresh start.
`claim_run_dir` locks `trainer.default_local_dir` for this run, resolves the resume point and refuses
to start a new run on top of an old one (or moves the old one aside when asked), so the driver and the
workers never look at `resume_mode` or the marker file again. `refuse_early` makes the checks of the
directory that need neither the lock nor the data, so a launch into a busy or occupied directory is
refused in a second, before the tokenizer and the data are read. `check_lora_targets` finds LoRA
targets that match no module of the model, and `unknown_agent_name` a row naming an agent loop that
does not exist, before any worker starts. `cpu_has_native_bf16` tells
the start-up whether bf16 compute on this machine's CPU is worth it.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, Optional, Tuple

from ballast.trainer.run.checkpoints import (
    CheckpointError, CheckpointManager, ResumePoint, choose_checkpoint, refused_file, verify_checkpoint,
)
from ballast.trainer.config import BallastConfig
from ballast.trainer.config.schema import TrainerConfig
from ballast.trainer.run.run_dir import RunDirLock, check_fresh_start, check_not_busy, lock_run_dir


def claim_run_dir(cfg: BallastConfig) -> Tuple[ResumePoint, RunDirLock]:
    """(where the run starts, the held lock on its directory).

    Raises `RunDirError` (directory busy, unusable, or holding a run this one would start on top of:
    `disable`, `auto` without a complete checkpoint, a checkpoint of another directory) or
    `CheckpointError` (the checkpoint named explicitly fails verification); both name the directory
    and what to do.
    """
    t = cfg.trainer
    lock = lock_run_dir(t.default_local_dir)
    try:
        point = resume_point(t)
        moved = check_fresh_start(t.default_local_dir, t.resume_mode, point.checkpoint, t.move_old_run_aside)
        if moved:
            say(f"moved the run that was in {t.default_local_dir!r} to {moved!r} (trainer.move_old_run_aside=true"
                f"{'; it had no complete checkpoint to continue from' if t.resume_mode == 'auto' else ''})")
        if not point.fresh:
            CheckpointManager(t.default_local_dir).warn_if_low_on_space()
    except BaseException:
        lock.release()
        raise
    return point, lock


def refuse_early(t: TrainerConfig) -> None:
    """Raise the `RunDirError` that `claim_run_dir` would raise for a directory held by another run, or
    for a fresh start (`resume_mode=disable`) on top of an old run that is not to be moved aside. It
    changes nothing on disk; `claim_run_dir` checks again under the lock (the directory can change in
    between), and makes every check that reads checkpoints."""
    run_dir = os.path.abspath(os.path.expanduser(t.default_local_dir))
    check_not_busy(run_dir)
    if t.resume_mode == "disable" and not t.move_old_run_aside:
        check_fresh_start(run_dir, t.resume_mode, None, move_old_run_aside=False)


def resume_point(t: TrainerConfig) -> ResumePoint:
    """Where a run with these `trainer` settings starts (see `choose_checkpoint` for `auto`)."""
    mode = t.resume_mode
    if mode == "disable":
        return ResumePoint()
    if mode == "auto":
        path, warnings = choose_checkpoint(os.path.abspath(os.path.expanduser(t.default_local_dir)), verify=True)
        for line in warnings:
            say(f"warning: {line}")
        return ResumePoint() if path is None else _point(path, "trainer.resume_mode=auto")
    key = "trainer.resume_from_path" if mode == "resume_path" else "trainer.resume_mode"
    path = os.path.abspath(os.path.expanduser(t.resume_from_path if mode == "resume_path" else mode))
    problem = verify_checkpoint(path)
    if problem is not None:
        intact, _ = choose_checkpoint(os.path.dirname(path.rstrip(os.sep)), verify=True)
        hint = (f"the newest intact checkpoint beside it is {intact!r} (trainer.resume_from_path={intact})"
                if intact and intact != path else "no intact checkpoint beside it")
        raise CheckpointError(f"cannot resume from {path!r}: {problem}; {hint}, or start over with "
                              "trainer.resume_mode=disable in a new trainer.default_local_dir")
    return _point(path, key)


def _point(path: str, key: str) -> ResumePoint:
    """The resume point of the verified checkpoint `path` (chosen by config `key`), once none of the
    files the resume reads is refused."""
    refused = refused_file(path)
    if refused is not None:
        raise CheckpointError(f"cannot resume from {path!r} ({key}): {refused}")
    try:
        step = int(CheckpointManager.read_state(path)["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as err:  # a checkpoint from before checksums existed
        raise CheckpointError(f"cannot resume from {path!r}: its trainer_state.json is unreadable "
                              f"({type(err).__name__}: {err})") from None
    return ResumePoint(path.rstrip(os.sep), step)


def check_lora_targets(plan) -> None:
    """Every LoRA adapter of `plan` adapts linear modules of its model, checked on a weightless copy of
    the model before any worker starts (`ballast.engine.lora.check_targets`); a `ConfigError` naming
    `<model>.target_modules` (or `<model>.lora_adapter_path`) otherwise."""
    from ballast.engine.lora import check_targets
    from ballast.trainer.config.keys import build
    from ballast.trainer.run.builders import MODEL_PREFIX

    critic = plan.specs.critic
    for role, engine in (("actor", plan.specs.actor_rollout_ref.actor), ("critic", critic.critic if critic else None)):
        if engine is not None and engine.lora.enabled:
            prefix = MODEL_PREFIX[role]
            build({"target_modules": f"{prefix}.target_modules", "adapter_path": f"{prefix}.lora_adapter_path"},
                  check_targets, engine.model_path, engine.lora, role, engine.trust_remote_code)


def unknown_agent_name(plan, agent_names: Dict[str, str]) -> Optional[str]:
    """None when every `agent_name` of the data (`agent_names`: name -> the first row naming it) is an
    agent loop of the run, else what is wrong, naming the file and row: found over all rows before any
    worker starts, not when the row is drawn. A trainer pool of its own (no rollout) reads none."""
    from ballast.trainer.run.builders import agent_loop_names

    specs = plan.specs
    agent = specs.actor_rollout_ref.agent or (specs.rollout.agent if specs.rollout is not None else None)
    if agent is None or not agent_names:
        return None
    loops = agent_loop_names(agent)
    for name, where in agent_names.items():
        if name not in loops:
            return (f"{where}: agent_name={name!r} is not an agent loop; registered: {loops} "
                    "(actor_rollout_ref.rollout.agent.agent_loop_config_path adds loops)")
    return None


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU multiplies bf16 natively (x86 avx512_bf16 / amx_bf16, Arm bf16); False
    where that cannot be read."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.split(":", 1)[0].strip() in ("flags", "Features")), [])
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(flags))


def say(line: str) -> None:
    """A start-up line on stderr, as `ballast: <line>`."""
    print(f"ballast: {line}", file=sys.stderr, flush=True)
