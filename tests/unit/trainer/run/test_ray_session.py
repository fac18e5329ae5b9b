"""A local Ray instance leaves nothing behind: one that does not start is a named exit (5) with its
processes stopped and its directory removed; a driver killed with SIGKILL is cleaned up after by its
watchdog; a normal stop also ends the processes that outlive `ray.shutdown()`. Ray itself is replaced
by stand-in processes that hold files in the session directory, as Ray's own processes do."""

import os
import signal
import subprocess
import sys
import time

import pytest

from ballast.trainer.run import ray_session, ray_watchdog
from ballast.trainer.config import load_config
from ballast.trainer.main import EXIT_RAY_UNAVAILABLE, failure

from testkit.e2e import overrides

# A stand-in for a Ray process: its own session (so it outlives its parent, as Ray's agents do), a log
# file open in the session directory, and `ray::` in its name like the renamed agents.
_RAY_LIKE = """
import os, sys, time
os.setsid()
log = open(os.path.join(sys.argv[1], "agent.log"), "w")
print("ready", flush=True)
time.sleep(300)
"""


def _ray_like(temp_dir):
    proc = subprocess.Popen([sys.executable, "-c", _RAY_LIKE, temp_dir], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _gone(pid, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not ray_watchdog._alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture()
def fresh_ray(monkeypatch, tmp_path):
    import ray

    if ray.is_initialized():
        pytest.skip("needs a process without an initialised Ray")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    return ray


def test_a_local_ray_that_does_not_start_is_exit_5_and_leaves_nothing(fresh_ray, monkeypatch, tmp_path):
    started = []

    def init_times_out(**kwargs):  # what ray.init does when the raylet misses its 30 s to register
        started.append(_ray_like(kwargs["_temp_dir"]))
        raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")

    monkeypatch.setattr(fresh_ray, "init", init_times_out)
    cfg = load_config(overrides({"model": "/m", "train": "/t.parquet", "val": "/v.parquet"}, str(tmp_path / "run")))
    try:
        with pytest.raises(ray_session.RayUnavailableError) as info:
            ray_session.start_ray(cfg)
        code, line = failure(info.value)
        assert code == EXIT_RAY_UNAVAILABLE
        assert line.startswith("ray cluster: the local Ray instance did not start: The current node timed out during "
                               "startup.") and "removed" in line, line
        assert [p for p in os.listdir(tmp_path) if p.startswith("ray_")] == [], "the session directory was left"
        assert _gone(started[0].pid), "a process of the half-started Ray was left running"
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


_DRIVER = """
import subprocess, sys, time
from ballast.trainer.run import ray_session
temp_dir = sys.argv[1]
watchdog = ray_session._start_watchdog(temp_dir)
agent = subprocess.Popen([sys.executable, "-c", sys.argv[2], temp_dir], stdout=subprocess.PIPE, text=True)
agent.stdout.readline()
print(agent.pid, watchdog.pid, flush=True)
time.sleep(300)
"""


def test_the_watchdog_stops_what_a_killed_driver_left_and_removes_its_directory(tmp_path):
    temp_dir = str(tmp_path / "ray_session")
    os.makedirs(temp_dir)
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, temp_dir, _RAY_LIKE], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    agent, watchdog = map(int, driver.stdout.readline().split())
    try:
        # found by its open file, not its name (the driver and watchdog here have the path in their arguments)
        assert ray_watchdog.processes_using(temp_dir, exclude=[driver.pid, watchdog]) == [agent]
        driver.send_signal(signal.SIGKILL)
        _, err = driver.communicate(timeout=60)  # returns once the watchdog, sharing stderr, has ended
        assert _gone(agent) and _gone(watchdog), "the agent or the watchdog outlived the killed driver"
        assert not os.path.exists(temp_dir)
        assert "ballast: watchdog: the driver ended without stopping its local Ray; stopped 1 Ray process(es)" in err
    finally:
        for pid in (agent, watchdog):
            if ray_watchdog._alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_normal_stop_ends_processes_that_outlive_ray_shutdown_and_releases_the_watchdog(fresh_ray, tmp_path):
    temp_dir = str(tmp_path / "ray_stop")
    os.makedirs(temp_dir)
    session = ray_session.RaySession(connected=False, temp_dir=temp_dir, watchdog=ray_session._start_watchdog(temp_dir))
    watchdog = session.watchdog
    agent = _ray_like(temp_dir)
    try:
        session.stop()
        assert watchdog.poll() == 0 and agent.wait(timeout=10) is not None
        assert not os.path.exists(temp_dir)
    finally:
        agent.kill()
        agent.wait()


def test_processes_using_ignores_others_and_end_processes_escalates_to_sigkill(tmp_path):
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time, sys\n"
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
                                 "time.sleep(300)"], stdout=subprocess.PIPE, text=True, cwd=str(tmp_path))
    try:
        assert stubborn.stdout.readline().strip() == "ready"
        assert ray_watchdog.processes_using(str(tmp_path)) == [stubborn.pid]  # its working directory
        assert ray_watchdog.processes_using(str(tmp_path / "other")) == []
        start = time.monotonic()
        assert ray_watchdog.end_processes([stubborn.pid], grace_s=0.5) == [stubborn.pid]
        assert stubborn.wait(timeout=10) == -signal.SIGKILL and time.monotonic() - start < 8
    finally:
        stubborn.kill()
        stubborn.wait()


def test_a_local_ray_gets_every_workers_cpus_and_oversubscribed_threads_are_said():
    from ballast.trainer.run.ray_session import local_num_cpus

    assert local_num_cpus(2, 1, 2, None) == (2, "")
    assert local_num_cpus(4, 1, 2, None) == (4, "")  # more 1-thread processes than cores: allowed, quiet
    assert local_num_cpus(1, 2, 2, None) == (2, "")
    cpus, warning = local_num_cpus(2, 2, 2, None)
    assert cpus == 4 and "trainer.cpus_per_worker=2 = 4 threads on 2 cores" in warning
    assert local_num_cpus(2, 2, 2, 16) == (16, "")  # ray_init.num_cpus is the user's word
