"""Run checkpoints: atomic step directories, the driver's own state, resume and retention.

A checkpoint is `<root>/global_step_<k>/` holding the workers' sharded engine state (`actor/`,
`critic/`) and `trainer_state.json` (step, dataloader position, KL coefficient, RNG states). It is
written under a temporary name and renamed into place only when complete, and only then does
`latest_checkpointed_iteration.txt` move forward, so a crash during a save leaves the previous
checkpoint intact and discoverable. No pickle is involved on the driver side (JSON only); the engine
state is read back by torch.distributed.checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Callable, List, Optional

import numpy as np
import torch

LATEST = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.json"
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


class CheckpointManager:
    def __init__(self, root: str, max_to_keep: Optional[int] = None) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"trainer.max_actor_ckpt_to_keep={max_to_keep} must be >= 1 or null")
        self.root = os.path.abspath(root)
        self.max_to_keep = max_to_keep

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"global_step_{step}")

    def save(self, step: int, save_workers: Callable[[str], None], trainer_state: dict) -> str:
        """Write checkpoint `step`: workers first (into a temp dir), then the driver state, then rename."""
        os.makedirs(self.root, exist_ok=True)
        final = self.step_dir(step)
        tmp = os.path.join(self.root, f".tmp_global_step_{step}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_workers(tmp)
        _atomic_write(os.path.join(tmp, STATE), json.dumps({"global_step": step, **trainer_state}))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        _atomic_write(os.path.join(self.root, LATEST), str(step))
        self._prune()
        return final

    def steps(self) -> List[int]:
        if not os.path.isdir(self.root):
            return []
        found = [int(m.group(1)) for name in os.listdir(self.root) if (m := _STEP_DIR.match(name))
                 and os.path.isfile(os.path.join(self.root, name, STATE))]
        return sorted(found)

    def latest(self) -> Optional[str]:
        """The newest complete checkpoint directory, or None."""
        marker = os.path.join(self.root, LATEST)
        if os.path.isfile(marker):
            step = int(open(marker).read().strip())
            if os.path.isfile(os.path.join(self.step_dir(step), STATE)):
                return self.step_dir(step)
        steps = self.steps()
        return self.step_dir(steps[-1]) if steps else None

    @staticmethod
    def read_state(path: str) -> dict:
        state_file = os.path.join(path, STATE)
        if not os.path.isfile(state_file):
            raise ValueError(f"{path!r} is not a Ballast checkpoint (no {STATE}); point trainer.resume_from_path "
                             "at a global_step_<k> directory")
        with open(state_file) as f:
            return json.load(f)

    def _prune(self) -> None:
        if self.max_to_keep is None:
            return
        for step in self.steps()[:-self.max_to_keep]:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)
