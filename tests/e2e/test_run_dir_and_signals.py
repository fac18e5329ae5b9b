"""The real command line under the faults a scheduler and a busy user produce: SIGTERM mid-run
(exit 143, `ballast: terminated`, optionally a checkpoint of the finished step), a second run into a
directory in use (exit 2 naming the holder's pid), a fresh start on top of an old run (exit 2), Ctrl-C
or SIGTERM repeated while the run shuts down (the shutdown finishes, exit 130 / 143), a driver killed
with SIGKILL (its watchdog stops the rest), and no Ray process or session directory left afterwards."""

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from testkit.e2e import killed_on_exit, last_line, logged_steps, start_trainer, wait_for
from testkit.procs import processes_using


def _cli(task, run_dir, *extra):
    return start_trainer(task, run_dir, "trainer.worker_timeout_s=120", *extra)


# The shutdown tests need a run with Ray processes to stop, not a second rank: one worker each. (The
# checkpoint-on-SIGTERM test keeps two: a sharded save is what a signal must not cut; a dead rank is
# tests/e2e/test_faults.py.)
ONE_WORKER = ("trainer.n_gpus_per_node=1", "ray_init.num_cpus=1")


@pytest.mark.slow
def test_sigterm_saves_the_step_and_the_directory_admits_one_run_at_a_time(tiny_task, tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    # far more steps than the test waits for: the signal must land mid-run even when the second
    # (refused) launch is slow to start on a loaded machine
    with killed_on_exit(_cli(tiny_task, run_dir, "trainer.total_training_steps=1000",
                             "trainer.save_on_signal=true")) as first:
        wait_for(lambda: os.path.isfile(os.path.join(run_dir, "workers.json")), first, 240, "workers")
        second = _cli(tiny_task, run_dir, "trainer.resume_mode=auto")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err[-3000:]
        assert last_line(err) .startswith(
            f"ballast: run directory: trainer.default_local_dir='{run_dir}' is in use by another run "
            f"(pid {first.pid} on host {socket.gethostname()} since "), err[-3000:]

        wait_for(lambda: logged_steps(run_dir), first, 240, "first step")
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
    assert first.returncode == 143, err[-3000:]
    assert last_line(err) == "ballast: terminated" and "Aborted" not in err and "SIGTERM received" not in err
    steps = logged_steps(run_dir)
    saved = int(Path(run_dir, "latest_checkpointed_iteration.txt").read_text())
    assert saved == steps[-1] < 1000, (saved, steps)  # the step under way when the signal came was finished, then saved
    assert Path(run_dir, f"global_step_{saved}", "checksums.json").is_file()
    ray_dir = re.search(r"local Ray session in (\S+)", out).group(1)
    assert not os.path.exists(ray_dir), f"{ray_dir} was left behind"

    fresh = _cli(tiny_task, run_dir)  # overrides() sets resume_mode=disable
    _, err = fresh.communicate(timeout=120)
    assert fresh.returncode == 2 and "already holds a run" in last_line(err), err[-3000:]
    assert logged_steps(run_dir) == steps, "the refused run must not touch the old run's files"


def _ray_dir(out):
    return re.search(r"local Ray session in (\S+)", out).group(1)


def _alive(pid):
    """Whether `pid` is a running process (a zombie waiting for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _hammer(proc, signum, seconds):
    """Send `signum` every 0.1 s until `proc` ends (at most `seconds`); how many were sent."""
    sent, deadline = 0, time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signum)
        sent += 1
        time.sleep(0.1)
    return sent


def _assert_shutdown_finished(proc, out, err, code, line):
    ray_dir = _ray_dir(out)
    left = processes_using(ray_dir)  # right at exit: the shutdown must have finished everything
    assert proc.returncode == code and last_line(err) == line, err[-3000:]
    assert "ballast: already stopping" in err and "Traceback" not in err, err[-3000:]
    assert not left, f"processes of the run's Ray still running after the driver exited: {left}"
    assert not os.path.exists(ray_dir), f"{ray_dir} was left behind"


@pytest.mark.slow
def test_one_sigterm_without_save_stops_at_once_and_more_during_the_shutdown_cannot_cut_it_short(tiny_task, tmp_path):
    # One run for two properties: a single SIGTERM (save_on_signal=false) stops the run mid-step with
    # exit 143 and no checkpoint; once its workers are gone (the shutdown is under way, started by that
    # one signal alone), SIGTERMs hammered until the driver exits are only noted.
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    with killed_on_exit(_cli(tiny_task, run_dir, "trainer.total_training_steps=50", *ONE_WORKER)) as proc:
        wait_for(lambda: logged_steps(run_dir), proc, 240, "first step")
        workers = [w["pid"] for w in json.loads(Path(run_dir, "workers.json").read_text())]
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_for(lambda: not all(_alive(pid) for pid in workers), proc, 30, "a worker stopped after one SIGTERM")
        sent = _hammer(proc, signal.SIGTERM, 60)
        out, err = proc.communicate(timeout=60)
        exit_s = time.monotonic() - signalled
    assert sent > 0, "the driver exited before a second SIGTERM could be sent"
    _assert_shutdown_finished(proc, out, err, 143, "ballast: terminated")
    assert exit_s < 30, f"took {exit_s:.0f}s to stop"
    assert not Path(run_dir, "latest_checkpointed_iteration.txt").exists()  # save_freq=-1, save_on_signal=false


@pytest.mark.slow
def test_ctrl_c_hammered_from_the_first_press_cannot_cut_the_shutdown_short(tiny_task, tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    with killed_on_exit(_cli(tiny_task, run_dir, "trainer.total_training_steps=50", *ONE_WORKER)) as proc:
        wait_for(lambda: logged_steps(run_dir), proc, 240, "first step")
        # a Ctrl-C hammered until the run is gone: the first stops the run, the rest land during its shutdown
        _hammer(proc, signal.SIGINT, 90)
        out, err = proc.communicate(timeout=60)
    _assert_shutdown_finished(proc, out, err, 130, "ballast: interrupted")


@pytest.mark.slow
def test_a_driver_killed_with_sigkill_leaves_no_ray_process_or_directory(tiny_task, tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    with killed_on_exit(_cli(tiny_task, run_dir, "trainer.total_training_steps=50", *ONE_WORKER)) as proc:
        wait_for(lambda: logged_steps(run_dir), proc, 240, "first step")
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=150)
    ray_dir = _ray_dir(out)
    while (processes_using(ray_dir) or os.path.exists(ray_dir)) and time.monotonic() - killed < 20:
        time.sleep(0.2)
    left = processes_using(ray_dir)
    assert not left, f"processes of the killed run's Ray still running {time.monotonic() - killed:.0f}s later: {left}"
    assert not os.path.exists(ray_dir), f"{ray_dir} was left behind"
