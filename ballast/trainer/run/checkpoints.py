"""Run checkpoints: atomic step directories, the driver's own state, resume and retention.

A checkpoint is `<root>/global_step_<k>/` holding the workers' sharded engine state (`actor/`,
`critic/`) and `trainer_state.json` (step, dataloader position, KL coefficient, RNG states). A save
cannot leave a name that claims more than is on disk: everything is written under a temporary name,
`checksums.json` last, every file and directory is flushed to the disk (fsync), then the directory is
renamed into place, and only then does `latest_checkpointed_iteration.txt` move forward (itself
written aside, flushed and renamed). A crash at any point leaves the previous checkpoint intact and
discoverable. A checkpoint of the same step that already exists is moved aside before the new one
takes its name and deleted after, so no half-deleted directory ever carries a checkpoint's name; the
same holds for the checkpoints retention removes, and for those of steps after the one saved: left by
a run that was resumed from an earlier checkpoint, they belong to the history it abandoned. Nothing in a checkpoint can run code when it is read: the driver's
state is JSON, the rollouts generated ahead are JSON and safetensors (`ballast.protocol.storage`), the
engine state is read back by torch.distributed.checkpoint through restricted loaders
(`ballast.engine.safe_load`); `refused_file` finds, before any worker starts, a file the resume would
refuse (a pickle planted where a tensor file belongs, the pickle of rollouts an older version wrote).

Every complete checkpoint carries `checksums.json` (size and SHA-256 of each file), so a truncated or
damaged shard is found on the driver before any worker loads it (`ballast.trainer.resume_choice`).
A save that fails removes its partial directory and, when the disk is full, says so
(`CheckpointError`, naming the directory and the free space); before each save the free space is
compared with the size of the last checkpoint and a warning is printed when it looks too small.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from ballast.trainer.run import fault_injection

LATEST = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.json"
CHECKSUMS = "checksums.json"
AHEAD_DIR = "rollouts_ahead"  # the rollouts generated ahead (`ballast.trainer.step.rollout_pipeline`)
LEGACY_AHEAD_FILE = "rollouts_ahead.pkl"  # what Ballast wrote there before checkpoints held no pickles
_HASH_CHUNK_BYTES = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint could not be written (disk full, ...) or read back (damaged, incomplete)."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: `trainer.resume_mode` resolved before Ray starts (`ballast.trainer.run.preflight`).

    `checkpoint` is a complete `global_step_<k>` directory that matched its checksums and `step` the step
    it holds; a fresh start is `ResumePoint()` (no checkpoint, step 0). The trainer loads it through
    `RayPPOTrainer.resume` and never reads `resume_mode` or the marker file itself.
    """

    checkpoint: Optional[str] = None
    step: int = 0

    @property
    def fresh(self) -> bool:
        return self.checkpoint is None


_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "python": [list(random.getstate()[1]), random.getstate()[0], random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }


def set_rng_state(state: dict) -> None:
    internal, version, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(os.path.dirname(path))


def _fsync(path: str) -> None:
    """Flush `path` (a file, or a directory's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: str) -> None:
    """Flush every file under `directory` and every directory's entries, deepest first: what the workers
    wrote is on the disk before any name says the checkpoint is complete (a machine that loses power
    after the rename keeps data, not empty files the checksums would reject)."""
    for base, _, files in os.walk(directory, topdown=False):
        for name in files:
            _fsync(os.path.join(base, name))
        _fsync(base)


def _remove_dir(root: str, path: str) -> None:
    """Delete checkpoint directory `path` without leaving a partial one under its name: it is renamed
    to a hidden name first (ignored by every reader), then deleted."""
    doomed = os.path.join(root, f".deleting_{os.path.basename(path)}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    _fsync(root)
    shutil.rmtree(doomed, ignore_errors=True)


class CheckpointManager:
    def __init__(self, root: str, max_to_keep: Optional[int] = None) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"trainer.max_actor_ckpt_to_keep={max_to_keep} must be >= 1 or null")
        self.root = os.path.abspath(root)
        self.max_to_keep = max_to_keep

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"global_step_{step}")

    def save(self, step: int, save_workers: Callable[[str], None], trainer_state: dict) -> str:
        """Write checkpoint `step`: workers first (into a temp dir), then the driver state and the
        checksums, then rename. A failure removes the temp dir; a full disk is named as the cause."""
        os.makedirs(self.root, exist_ok=True)
        self.warn_if_low_on_space()
        final = self.step_dir(step)
        tmp = os.path.join(self.root, f".tmp_global_step_{step}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.makedirs(tmp)
            save_workers(tmp)
            fault_injection.kill_point("saving", step)
            _atomic_write(os.path.join(tmp, STATE), json.dumps({"global_step": step, **trainer_state}))
            _fsync_tree(tmp)
            _atomic_write(os.path.join(tmp, CHECKSUMS), json.dumps(file_checksums(tmp), indent=0))
        except BaseException as err:
            free, partial = shutil.disk_usage(self.root).free, checkpoint_bytes(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(err):
                raise CheckpointError(
                    f"saving checkpoint global_step_{step} into {self.root!r} failed: no space left on device "
                    f"({_mib(free)} MiB free after writing {_mib(partial)} MiB; the partial directory was removed). "
                    "Free space there or point trainer.default_local_dir at a larger disk, then resume with "
                    "trainer.resume_mode=auto"
                ) from err
            raise
        if os.path.exists(final):
            _remove_dir(self.root, final)
        os.rename(tmp, final)
        _fsync(self.root)
        fault_injection.kill_point("saved", step)
        _atomic_write(os.path.join(self.root, LATEST), str(step))
        self._prune(step)
        return final

    def warn_if_low_on_space(self) -> Optional[str]:
        """Print (and return) a warning when the disk holds less than the last checkpoint's size."""
        steps = self.steps()
        if not steps:
            return None
        needed = checkpoint_bytes(self.step_dir(steps[-1]))
        free = shutil.disk_usage(self.root).free
        if free >= needed:
            return None
        message = (f"ballast: warning: {_mib(free)} MiB free in {self.root!r} but the last checkpoint "
                   f"(global_step_{steps[-1]}) took {_mib(needed)} MiB; the next save will likely fail")
        print(message, file=sys.stderr, flush=True)
        return message

    def steps(self) -> List[int]:
        if not os.path.isdir(self.root):
            return []
        found = [int(m.group(1)) for name in os.listdir(self.root) if (m := _STEP_DIR.match(name))
                 and os.path.isfile(os.path.join(self.root, name, STATE))]
        return sorted(found)

    def latest(self) -> Optional[str]:
        """The checkpoint `resume_mode=auto` continues from, or None (the rule of `choose_checkpoint`,
        without reading the files' data; the CLI runs the full check before Ray starts)."""
        return choose_checkpoint(self.root, verify=False)[0]

    @staticmethod
    def read_state(path: str) -> dict:
        state_file = os.path.join(path, STATE)
        if not os.path.isfile(state_file):
            raise ValueError(f"{path!r} is not a Ballast checkpoint (no {STATE}); point trainer.resume_from_path "
                             "at a global_step_<k> directory")
        with open(state_file) as f:
            return json.load(f)

    def _prune(self, saved: int) -> None:
        """After saving step `saved`: remove the checkpoints of later steps (module docstring), then the
        oldest beyond `max_to_keep`."""
        steps = _step_numbers(self.root)
        kept = [s for s in steps if s <= saved]
        doomed = [s for s in steps if s > saved]
        if self.max_to_keep is not None:
            doomed += kept[:-self.max_to_keep]
        for step in doomed:
            _remove_dir(self.root, self.step_dir(step))


def file_checksums(directory: str) -> Dict[str, dict]:
    """{relative path: {"bytes": size, "sha256": digest}} for every file under `directory`."""
    out = {}
    for base, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(base, name)
            out[os.path.relpath(path, directory)] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    return dict(sorted(out.items()))


def verify_checkpoint(path: str) -> Optional[str]:
    """None when `path` is complete and matches its checksums, else what is wrong (naming the file).

    A checkpoint written before checksums existed (no checksums.json) is only checked for its state file.
    """
    if not os.path.isfile(os.path.join(path, STATE)):
        return f"{os.path.join(path, STATE)} is missing (an incomplete checkpoint)"
    manifest_path = os.path.join(path, CHECKSUMS)
    if not os.path.isfile(manifest_path):
        return None
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        return f"{manifest_path} is unreadable ({err})"
    for rel, want in manifest.items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            return f"{file} is missing"
        size = os.path.getsize(file)
        if size != want["bytes"]:
            return f"{file} has {size} bytes, {want['bytes']} when saved (truncated or overwritten)"
    for rel, want in manifest.items():  # sizes first: they catch truncation without reading any data
        if _sha256(os.path.join(path, rel)) != want["sha256"]:
            return f"{os.path.join(path, rel)} does not match its SHA-256 from save time (damaged)"
    return None


def legacy_pickle_refusal(file: str) -> str:
    return (f"{file}: refused: a pickle (loading it could run code), written by an older Ballast; this version "
            "loads no pickles: resume with the version that wrote it, or start over (trainer.resume_mode=disable)")


def refused_file(path: str) -> Optional[str]:
    """None when the files the resume reads from checkpoint `path` are in formats that cannot run code,
    else what is refused, naming the file: a pickle where an engine state or DCP's metadata belongs, the
    pickle of rollouts an older version wrote, rollouts that are not JSON. (DCP's per-item values inside
    the shards are checked as the workers read them.)"""
    from ballast.engine.checkpoint import DCP_DIR, ENGINE_STATE_FILE
    from ballast.engine.safe_load import METADATA_FILE, RefusedFileError, load_torch_file, read_dcp_metadata
    from ballast.protocol.storage import TREE_FILE

    if os.path.exists(os.path.join(path, LEGACY_AHEAD_FILE)):
        return legacy_pickle_refusal(os.path.join(path, LEGACY_AHEAD_FILE))
    tree = os.path.join(path, AHEAD_DIR, TREE_FILE)
    if os.path.exists(tree):
        try:
            with open(tree) as f:
                json.load(f)
        except (OSError, ValueError) as err:
            return f"{tree} is not JSON ({err})"
    try:
        for base, _, files in sorted(os.walk(path)):
            if os.path.basename(base) == DCP_DIR and METADATA_FILE in files:
                read_dcp_metadata(os.path.join(base, METADATA_FILE))
            if ENGINE_STATE_FILE in files:
                load_torch_file(os.path.join(base, ENGINE_STATE_FILE))
    except RefusedFileError as err:
        return str(err)
    return None


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(base, name)) for base, _, files in os.walk(path) for name in files)


def is_disk_full(err: BaseException) -> bool:
    """Whether `err`, anything in its cause chain or its text (a worker's remote traceback) says ENOSPC."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(err) or "Disk quota exceeded" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / (1 << 20):.1f}"


def read_marker(root: str):
    """(step, None) when `latest_checkpointed_iteration.txt` holds a step number, else (None, what is wrong)."""
    marker = os.path.join(root, LATEST)
    if not os.path.isfile(marker):
        return None, f"{marker} is missing"
    try:
        with open(marker, errors="replace") as f:
            text = f.read(64).strip()
    except OSError as err:
        return None, f"{marker} is unreadable ({err.strerror})"
    if not text:
        return None, f"{marker} is empty"
    if not (text.isascii() and text.isdigit()):  # str.isdigit() also takes '²' (int() fails) and other scripts' digits
        return None, f"{marker} holds {text[:20]!r}, not a step number"
    return int(text), None


def choose_checkpoint(root: str, verify: bool = True):
    """(checkpoint directory or None, warnings): what `resume_mode=auto` continues from.

    One rule: the step the marker file names, when the marker holds a number and that checkpoint is
    complete (and, with `verify`, matches its checksums); otherwise the newest checkpoint that is, with
    a warning saying what was wrong and what was chosen. No checkpoint and no marker is a fresh start
    without a warning.
    """
    step, problem = read_marker(root)
    manager = CheckpointManager(root)
    if step is not None:
        path = manager.step_dir(step)
        problem = (f"{os.path.join(root, LATEST)} names step {step}, but {path} does not exist"
                   if not os.path.isdir(path) else _check(path, verify))
        if problem is None:
            return path, []
    candidates = [s for s in reversed(_step_numbers(root)) if s != step]
    if step is None and not candidates and not os.path.isfile(os.path.join(root, LATEST)):
        return None, []  # a new run directory
    warnings = [problem]
    for other in candidates:
        path = manager.step_dir(other)
        bad = _check(path, verify)
        if bad is None:
            return path, warnings + [f"resuming from {path}, the newest complete checkpoint"]
        warnings.append(f"skipping {path}: {bad}")
    return None, warnings + [f"no complete checkpoint in {root!r}"]


def _check(path: str, verify: bool) -> Optional[str]:
    if verify:
        return verify_checkpoint(path)
    return None if os.path.isfile(os.path.join(path, STATE)) else f"{os.path.join(path, STATE)} is missing"


def _step_numbers(root: str) -> List[int]:
    """Every global_step_<k> directory, complete or not, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := _STEP_DIR.match(name)))
