"""The end-of-suite check (tests/testkit/leaks.py) fails a run that leaves a process running (also one
orphaned by its parent, which a plain child listing misses) or a Ray session directory behind, cleans
them up, and passes a run that leaves nothing."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

_TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CONFTEST = "from testkit.leaks import pytest_sessionfinish, pytest_sessionstart, pytest_testnodedown  # noqa: F401\n"

# In this process and on a pytest-xdist worker (as scripts/test.sh runs the suite): the worker's own
# check must reach the controller, whose exit status is the run's.
MODES = pytest.mark.parametrize("args", [[], ["-n", "1"]], ids=["serial", "xdist"])

_LEAKY = textwrap.dedent('''
    import os, subprocess, sys

    def test_leaves_an_orphan_and_a_ray_directory(tmp_path):
        marker = os.environ["LEAK_MARKER"]
        # the middle process exits at once: its child is orphaned and would be re-parented to init
        subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                        "'import time, sys; time.sleep(120)', sys.argv[1]], start_new_session=True)", marker],
                       check=True)
        os.makedirs(os.path.join(os.environ["RAY_TMPDIR"], "ray_leftover", "session_x"))
''')

_CLEAN = textwrap.dedent('''
    import os, subprocess, sys
    from multiprocessing import shared_memory

    def test_cleans_up_after_itself():
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        # starts the standard library's resource tracker, a helper of pytest's own that ends with it
        shm = shared_memory.SharedMemory(create=True, size=16)
        shm.close()
        shm.unlink()
        path = os.path.join(os.environ["RAY_TMPDIR"], "ray_done")
        os.makedirs(path)
        os.rmdir(path)
''')


def _run_suite(tmp_path, body, marker, args):
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_inner.py").write_text(body)
    # a 1 s grace instead of 10 s: the leaky suite's sleeper never ends by itself, so the wait buys nothing
    env = {**os.environ, "LEAK_MARKER": marker, "LEAK_CHECK_GRACE_S": "1",
           "PYTHONPATH": os.pathsep.join([_TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-c", os.devnull, *args, str(tmp_path)], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=300)


def _with_marker(marker):
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in open(f"/proc/{entry}/cmdline", "rb").read():
                found.append(int(entry))
        except OSError:
            pass
    return found


@MODES
def test_a_suite_that_leaves_an_orphaned_process_or_a_ray_directory_fails_and_is_cleaned_up(tmp_path, args):
    marker = f"leak-check-{os.getpid()}-{time.monotonic_ns()}"
    result = _run_suite(tmp_path, _LEAKY, marker, args)
    out = result.stdout + result.stderr
    try:
        assert result.returncode == 1, out
        assert "1 passed" in out and "left 1 process(es) running and 1 Ray session directory(ies) behind" in out, out
        assert marker in out and "ray_leftover" in out, out
        assert _with_marker(marker) == [], "the leftover process must be killed after it is reported"
    finally:
        for pid in _with_marker(marker):
            os.kill(pid, 9)


@MODES
def test_a_suite_that_leaves_nothing_passes(tmp_path, args):
    result = _run_suite(tmp_path, _CLEAN, "unused", args)
    assert result.returncode == 0 and "leftovers" not in result.stdout, result.stdout + result.stderr
