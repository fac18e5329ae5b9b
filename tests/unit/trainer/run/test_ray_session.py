"""A local Ray instance leaves nothing behind and ends nothing that is not the run's: one that does not
start is a named exit (5) with its processes stopped and its directory removed; a driver killed with
SIGKILL is cleaned up after by its watchdog; a normal stop also ends the processes that outlive
`ray.shutdown()`; and in every case a stranger's process naming the session directory (a `tail -f` of
a log, a shell inside it) survives. Ray itself is replaced by stand-in processes that hold files in
the session directory and carry the session's mark, as Ray's own processes do."""

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


def _ray_like(temp_dir, session_id=None):
    """A stand-in Ray process; with `session_id` it carries that session's mark (else it inherits this
    process's environment, as a process Ray starts does)."""
    env = dict(os.environ) if session_id is None else {**os.environ, ray_watchdog.MARK: session_id}
    proc = subprocess.Popen([sys.executable, "-c", _RAY_LIKE, temp_dir], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _strangers(temp_dir):
    """A user's processes naming the session directory: a `tail -f` of its log (command line and an
    open file under it) and a process whose working directory it is."""
    log = os.path.join(temp_dir, "agent.log")
    with open(log, "a"):
        pass
    tail = subprocess.Popen(["tail", "-f", log], stdout=subprocess.DEVNULL)
    shell = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], cwd=temp_dir)
    time.sleep(0.2)  # tail has opened the file
    return [tail, shell]


def _stop(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


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
    before = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}

    def init_times_out(**kwargs):  # what ray.init does when the raylet misses its 30 s to register
        os.makedirs(kwargs["_temp_dir"])
        started.append(_ray_like(kwargs["_temp_dir"]))  # started by "Ray": it inherits the session's mark
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
        assert {k: os.environ.get(k) for k in before} == before, "the driver's environment was not restored"
    finally:
        _stop(started)


_DRIVER = """
import os, subprocess, sys, time
from ballast.trainer.run import ray_session, ray_watchdog
temp_dir, session_id = sys.argv[1], sys.argv[2]
watchdog = ray_session._start_watchdog(temp_dir, session_id)
agent = subprocess.Popen([sys.executable, "-c", sys.argv[3], temp_dir], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, ray_watchdog.MARK: session_id})
agent.stdout.readline()
print(agent.pid, watchdog.pid, flush=True)
time.sleep(300)
"""


def test_the_watchdog_stops_what_a_killed_driver_left_and_removes_its_directory_but_no_stranger(tmp_path):
    temp_dir, session_id = str(tmp_path / "ray_session"), "s-killed"
    os.makedirs(temp_dir)
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, temp_dir, session_id, _RAY_LIKE],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    agent, watchdog = map(int, driver.stdout.readline().split())
    strangers = _strangers(temp_dir)
    try:
        # the agent by its mark; not the strangers, nor the driver and watchdog that name the path in their arguments
        assert ray_watchdog.session_processes(session_id) == [agent]
        driver.send_signal(signal.SIGKILL)
        _, err = driver.communicate(timeout=60)  # returns once the watchdog, sharing stderr, has ended
        assert _gone(agent) and _gone(watchdog), "the agent or the watchdog outlived the killed driver"
        assert not os.path.exists(temp_dir)
        assert "ballast: watchdog: the driver ended without stopping its local Ray; stopped 1 Ray process(es)" in err
        assert [p.poll() for p in strangers] == [None, None], "the watchdog ended a process that was not the run's"
    finally:
        _stop(strangers)
        for pid in (agent, watchdog):
            if ray_watchdog._alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_normal_stop_ends_processes_that_outlive_ray_shutdown_and_releases_the_watchdog(fresh_ray, tmp_path):
    temp_dir, session_id = str(tmp_path / "ray_stop"), "s-stop"
    os.makedirs(temp_dir)
    session = ray_session.RaySession(connected=False, temp_dir=temp_dir, session_id=session_id,
                                     watchdog=ray_session._start_watchdog(temp_dir, session_id))
    watchdog = session.watchdog
    agent = _ray_like(temp_dir, session_id)
    strangers = _strangers(temp_dir)
    try:
        session.stop()
        assert watchdog.poll() == 0 and agent.wait(timeout=10) is not None
        assert not os.path.exists(temp_dir)
        assert [p.poll() for p in strangers] == [None, None], "the stop ended a process that was not the run's"
    finally:
        _stop([agent, *strangers])


def test_only_the_sessions_mark_proves_a_process_is_the_runs_and_end_processes_escalates_to_sigkill(tmp_path):
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(300)"

    def start(mark):
        env = dict(os.environ, **({ray_watchdog.MARK: mark} if mark else {}))
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=str(tmp_path),
                                env=env)
        assert proc.stdout.readline().strip() == "ready"
        return proc

    stubborn, other_session, unmarked = start("s-1"), start("s-10"), start(None)
    try:
        assert ray_watchdog.session_processes("s-1") == [stubborn.pid]  # not a prefix match, not the working directory
        assert ray_watchdog.session_processes("") == []
        start_s = time.monotonic()
        assert ray_watchdog.end_processes([stubborn.pid], grace_s=0.5) == [stubborn.pid]
        assert stubborn.wait(timeout=10) == -signal.SIGKILL and time.monotonic() - start_s < 8
        assert other_session.poll() is None and unmarked.poll() is None
    finally:
        _stop([stubborn, other_session, unmarked])


def test_a_local_ray_gets_every_workers_cpus_and_oversubscribed_threads_are_said():
    from ballast.trainer.run.ray_session import local_num_cpus

    assert local_num_cpus(2, 1, 2, None) == (2, "")
    assert local_num_cpus(4, 1, 2, None) == (4, "")  # more 1-thread processes than cores: allowed, quiet
    assert local_num_cpus(1, 2, 2, None) == (2, "")
    cpus, warning = local_num_cpus(2, 2, 2, None)
    assert cpus == 4 and "trainer.cpus_per_worker=2 = 4 threads on 2 cores" in warning
    assert local_num_cpus(2, 2, 2, 16) == (16, "")  # ray_init.num_cpus is the user's word
