"""Deliberate crashes of the driver at named points of a step, to rehearse recovery on a real setup.

`BALLAST_KILL_AT=<point>@<step>` in the driver's environment makes the driver send itself SIGKILL
when the training loop reaches `<point>` of step `<step>` (steps count from 1, as in metrics.jsonl):
no Python cleanup runs, exactly as when the kernel's OOM killer or `kill -9` ends it. Whether a
resume (`trainer.resume_mode=auto`) then continues the run as if nothing happened can be checked on
the user's own storage and cluster, at a chosen point instead of a random one. Unset (the default)
nothing happens; a value naming no point is refused when the trainer starts.

Only the driver's loop reads the variable (Ray's processes get it too, with every `BALLAST_*`
setting, and ignore it), so only the driver dies; a local Ray and its workers then go down with it
through the watchdog (`ballast.trainer.run.ray_watchdog`), as after any SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Dict, Optional, Tuple

ENV = "BALLAST_KILL_AT"

POINTS: Dict[str, str] = {
    "generating": "the step's weights are final and the next batches are being generated (launched on the "
                  "workers, not yet waited for); nothing of the step is saved",
    "updated": "the step's updates are done on the workers (their weights changed) and the next batches not "
               "yet launched",
    "saving": "during the step's checkpoint save: the workers' files are written into the temporary "
              "directory, the driver's state and checksums not yet",
    "saved": "the step's checkpoint is complete and renamed into place, "
             "latest_checkpointed_iteration.txt not yet moved to it",
}


def armed(environ=os.environ) -> Optional[Tuple[str, int]]:
    """(point, step) that `BALLAST_KILL_AT` names, None when unset; ValueError naming the variable and
    the points when its value is not `<point>@<step>`."""
    value = environ.get(ENV, "").strip()
    if not value:
        return None
    point, _, step = value.partition("@")
    if point not in POINTS or not (step.isascii() and step.isdigit() and int(step) >= 1):
        raise ValueError(f"{ENV}={value!r} must be <point>@<step> with a step >= 1 and a point among "
                         f"{sorted(POINTS)}")
    return point, int(step)


def kill_point(point: str, step: int) -> None:
    """SIGKILL this process when `BALLAST_KILL_AT` names `point` of `step`."""
    assert point in POINTS, point  # a call site naming an undocumented point is a bug, not user input
    if armed() == (point, step):
        print(f"ballast: {ENV}: killing the driver (pid {os.getpid()}) at {point}@{step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
