"""The real command line under the faults a scheduler and a busy user produce: SIGTERM mid-run
(exit 143, `ballast: terminated`, optionally a checkpoint of the finished step), a second run into a
directory in use (exit 2 naming the holder's pid), a fresh start on top of an old run (exit 2), and no
Ray session directory left in /tmp afterwards."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e_helpers import overrides


def _cli(task, run_dir, *extra):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    args = overrides(task, run_dir, "actor_rollout_ref.rollout.n=2", "ray_init.num_cpus=2",
                     "trainer.worker_timeout_s=120", *extra)
    return subprocess.Popen([sys.executable, "-m", "ballast.trainer.main", *args], cwd=run_dir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _logged_steps(run_dir):
    path = Path(run_dir, "metrics.jsonl")
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _wait(condition, proc, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}:\n{proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.1)


def _last_line(stderr):
    lines = [line for line in stderr.splitlines() if line.startswith("ballast: ")]
    return lines[-1] if lines else stderr[-2000:]


@pytest.mark.slow
def test_sigterm_saves_the_step_and_the_directory_admits_one_run_at_a_time(tiny_task, tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    first = _cli(tiny_task, run_dir, "trainer.total_training_steps=20", "trainer.save_on_signal=true")
    try:
        _wait(lambda: os.path.isfile(os.path.join(run_dir, "workers.json")), first, 240, "workers")
        second = _cli(tiny_task, run_dir, "trainer.resume_mode=auto")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err[-3000:]
        assert _last_line(err) .startswith(
            f"ballast: run directory: trainer.default_local_dir='{run_dir}' is in use by another run "
            f"(pid {first.pid} on host {socket.gethostname()} since "), err[-3000:]

        _wait(lambda: _logged_steps(run_dir), first, 240, "first step")
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 143, err[-3000:]
    assert _last_line(err) == "ballast: terminated" and "Aborted" not in err and "SIGTERM received" not in err
    steps = _logged_steps(run_dir)
    saved = int(Path(run_dir, "latest_checkpointed_iteration.txt").read_text())
    assert saved == steps[-1] < 20, (saved, steps)  # the step under way when the signal came was finished, then saved
    assert Path(run_dir, f"global_step_{saved}", "checksums.json").is_file()
    ray_dir = re.search(r"local Ray session in (\S+)", out).group(1)
    assert not os.path.exists(ray_dir), f"{ray_dir} was left behind"

    fresh = _cli(tiny_task, run_dir)  # overrides() sets resume_mode=disable
    _, err = fresh.communicate(timeout=120)
    assert fresh.returncode == 2 and "already holds a run" in _last_line(err), err[-3000:]
    assert _logged_steps(run_dir) == steps, "the refused run must not touch the old run's files"


@pytest.mark.slow
def test_sigterm_without_save_stops_at_once_with_exit_143(tiny_task, tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    proc = _cli(tiny_task, run_dir, "trainer.total_training_steps=50")
    try:
        _wait(lambda: _logged_steps(run_dir), proc, 240, "first step")
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=120)
        exit_s = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143 and _last_line(err) == "ballast: terminated", err[-3000:]
    assert exit_s < 30, f"took {exit_s:.0f}s to stop"
    assert not Path(run_dir, "latest_checkpointed_iteration.txt").exists()  # save_freq=-1, save_on_signal=false
    assert not os.path.exists(re.search(r"local Ray session in (\S+)", out).group(1))
