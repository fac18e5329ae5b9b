"""Kill-and-resume proofs for the e2e tests: a tiny run SIGKILLed at a named point of a step
(`BALLAST_KILL_AT`, a subprocess with its own Ray), resumed in this process with `resume_mode=auto`
in the same run directory, and held to the uninterrupted run of the same config: the dataset rows
and prompt uids trained at every step, every per-step metric but the timing ones, and the final
parameters (the last step's exported weights)."""

import json
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np
import pytest
from safetensors.torch import load_file

from ballast.trainer.run.fault_injection import ENV
from testkit.e2e import killed_on_exit, latest_step, overrides, start_trainer

# what start_trainer adds to the tiny run; an in-process run of the same config needs the same
SUBPROCESS_RUN = ("actor_rollout_ref.rollout.n=2",)
MACHINE_SPEED = ("timing", "perf/", "timestamp")


@dataclass
class Run:
    """What a run trained and logged: per step the (dataset index, uid) of every row, in row order
    (`trained`, only the steps this process ran), every metrics row of its run directory, and the
    final parameters."""
    dir: str
    trained: Dict[int, List[Tuple[int, str]]] = field(default_factory=dict)
    rows: List[dict] = field(default_factory=list)
    params: Dict[str, object] = field(default_factory=dict)
    resumed_at: int = 0


def run_in_process(task, path, *extra) -> Run:
    """The tiny run in `path` in this process (the session's Ray), recording the rows each step trains."""
    from ballast.trainer.config import load_config
    from ballast.trainer.main import prepare_typed, training_session

    run = Run(path)
    cfg = load_config(overrides(task, path, *SUBPROCESS_RUN, *extra))
    with training_session(prepare_typed(cfg)) as trainer:
        run.resumed_at = trainer.global_step
        take = trainer.rollouts.take

        def recording_take(step):
            rollout, waited = take(step)
            batch = rollout.batch
            run.trained[step] = list(zip(np.asarray(batch["index"]).astype(int).tolist(),
                                         np.asarray(batch["uid"]).astype(str).tolist()))
            return rollout, waited

        trainer.rollouts.take = recording_take
        trainer.fit()
        last = trainer.global_step
    run.rows = metrics_rows(path)
    exported = os.path.join(path, f"global_step_{last}", "actor_hf")
    for name in sorted(os.listdir(exported)):
        if name.endswith(".safetensors"):
            run.params.update(load_file(os.path.join(exported, name)))
    assert run.params, f"no exported weights in {exported}"
    return run


def kill_at(task, path, point, step, *extra, timeout_s=300) -> int:
    """Run the tiny config as a subprocess SIGKILLed at `point` of `step`; the step of the checkpoint it
    left (what `resume_mode=auto` continues from). The subprocess imports `testkit` like this one (test
    agent loops)."""
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python_path = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH", "")) if p)
    proc = start_trainer(task, path, *extra, env={ENV: f"{point}@{step}", "PYTHONPATH": python_path})
    with killed_on_exit(proc):
        _, stderr = proc.communicate(timeout=timeout_s)
    assert proc.returncode == -9, stderr[-3000:]
    assert re.search(rf"killing the driver \(pid \d+\) at {point}@{step}", stderr), stderr[-3000:]
    return latest_step(path)


def metrics_rows(path) -> List[dict]:
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def deterministic(row) -> dict:
    """A metrics row without what depends on the machine's speed."""
    return {k: v for k, v in row.items() if not k.startswith(MACHINE_SPEED) and not k.endswith("/seconds")}


def assert_trained_like(reference: Run, resumed: Run, checkpoint_step: int, not_compared=()) -> None:
    """The resumed run went on from `checkpoint_step` (never from step 0), trained at every later step
    exactly the rows the uninterrupted run trained there, and the run directory's metrics, rows kept
    from before the kill included, equal the uninterrupted run's step for step (all but the keys in
    `not_compared`, which must be there too)."""
    assert checkpoint_step >= 1 and resumed.resumed_at == checkpoint_step
    last = max(reference.trained)
    assert sorted(resumed.trained) == list(range(checkpoint_step + 1, last + 1))
    for step, rows in resumed.trained.items():
        assert rows == reference.trained[step], f"step {step} trained other rows than the uninterrupted run"
    # no prompt used twice and none skipped: over the whole run every dataset row once (one epoch)
    indices = [sorted(set(i for i, _ in reference.trained[s])) for s in sorted(reference.trained)]
    flat = [i for step_rows in indices for i in step_rows]
    assert len(flat) == len(set(flat))
    assert [r["step"] for r in resumed.rows] == [r["step"] for r in reference.rows]
    for straight, again in zip(reference.rows, resumed.rows):
        expected, got = deterministic(straight), deterministic(again)
        assert sorted(got) == sorted(expected), straight["step"]
        for key, value in expected.items():
            if key in not_compared:
                continue
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (straight["step"], key)


def assert_same_parameters(reference: Run, resumed: Run) -> None:
    assert sorted(resumed.params) == sorted(reference.params)
    for name, tensor in reference.params.items():
        diff = (resumed.params[name].float() - tensor.float()).abs().max().item()
        assert diff <= 1e-5 * max(1.0, tensor.float().abs().max().item()), (name, diff)
