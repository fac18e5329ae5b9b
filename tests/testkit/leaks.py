"""A pytest plugin that fails the run when the suite leaves a process or a Ray session directory behind.

What the suite started is tracked, not guessed, so other users' processes and Ray clusters on the same
machine never count:

* processes: the pytest process makes itself a *child subreaper* (Linux `prctl`), so every process the
  suite starts stays its descendant even after the process between them exits (an orphaned Ray agent
  is re-parented to pytest instead of to init). At the end, every live descendant is a leftover.
* Ray session directories: `RAY_TMPDIR` (Ray's own variable, which Ballast's local Ray also follows)
  points at a fresh directory of this session, so every `ray_*` directory the suite's Ray instances
  create lands there. At the end, a `ray_*` directory left in it is a leftover (the directory itself,
  with anything else Ray kept there, is removed).

Leftovers are listed, the session's exit status is set to "tests failed", and then they are removed
(processes killed, directories deleted) so that one failing run does not burden the next. Processes
get a grace period first: Ray's processes end a moment after the call that stopped them returns.

Under pytest-xdist every worker checks what its own tests left (each worker is a pytest session, and a
subreaper of its own) and hands the list to the controller, which reports them all and fails the run:
a worker's own exit status does not reach the controller's.
"""

import ctypes
import os
import shutil
import signal
import tempfile
import time

import pytest

PR_SET_CHILD_SUBREAPER = 36
# LEAK_CHECK_GRACE_S: a shorter wait for the plugin's own test, whose leftover process never ends by itself.
GRACE_S = float(os.environ.get("LEAK_CHECK_GRACE_S", "10"))
_session = {}


def _become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: str):
    """(ppid, state) of a process from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), fields[0].decode()
    except (OSError, IndexError, ValueError):
        return None


def live_descendants(root_pid: int):
    """Pids of the running (not zombie) processes below `root_pid`."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _stat(entry)) is not None:
            children.setdefault(info[0], []).append((int(entry), info[1]))
    found, todo = [], [root_pid]
    while todo:
        for pid, state in children.get(todo.pop(), []):
            todo.append(pid)
            if state != "Z":
                found.append(pid)
    return sorted(found)


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmdline = "?"
    return f"pid {pid}: {cmdline[:160]}"


def _reap_zombie_children() -> None:
    """Collect the exit status of the orphans the subreaper inherited (nobody else waits for them)."""
    for entry in os.listdir("/proc"):
        info = _stat(entry) if entry.isdigit() else None
        if info is not None and info == (os.getpid(), "Z"):
            try:
                os.waitpid(int(entry), os.WNOHANG)
            except ChildProcessError:
                pass


def pytest_sessionstart(session):
    if not os.path.isdir("/proc"):
        return
    _session["subreaper"] = _become_subreaper()
    # short: Ray's socket paths below it must stay under the 107-byte Unix socket limit
    _session["ray_root"] = tempfile.mkdtemp(prefix="bt-", dir="/tmp")
    _session["old_ray_tmpdir"] = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = _session["ray_root"]


def _own_helpers() -> set:
    """Pids of the helper processes the standard library keeps for the pytest process itself (the
    multiprocessing resource tracker and forkserver, started on first use): they end with pytest,
    so they are not something a test left behind."""
    import multiprocessing.forkserver as forkserver
    import multiprocessing.resource_tracker as resource_tracker

    pids = {getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None)}
    return {pid for pid in pids if pid}


def find_leftovers():
    """(descriptions of live descendant processes, leftover entries of the session's Ray directory),
    after waiting up to GRACE_S for processes to end."""
    deadline = time.monotonic() + GRACE_S
    own = _own_helpers()
    while (pids := [p for p in live_descendants(os.getpid()) if p not in own]) and time.monotonic() < deadline:
        time.sleep(0.2)
    processes = [_describe(pid) for pid in pids]
    root = _session.get("ray_root")
    names = os.listdir(root) if root and os.path.isdir(root) else []
    # `ray_*`: a session directory Ballast (or a test) made and had to remove. Ray's own default
    # directory (`ray/`, from a `ray start` without --temp-dir) is Ray's to keep; it goes with the root.
    dirs = sorted(os.path.join(root, name) for name in names if name.startswith("ray_"))
    return pids, processes, dirs


def _clean(pids, dirs) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist, on the controller: a worker finished; keep what its own check found."""
    _session.setdefault("worker_lines", []).extend(getattr(node, "workeroutput", {}).get("ballast_leftovers", []))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if "ray_root" not in _session:
        return
    pids, processes, dirs = find_leftovers()
    _clean(pids, dirs)
    _reap_zombie_children()
    shutil.rmtree(_session["ray_root"], ignore_errors=True)
    if _session.get("old_ray_tmpdir") is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = _session["old_ray_tmpdir"]
    lines = []
    if processes or dirs:
        lines = [f"the test session left {len(processes)} process(es) running and {len(dirs)} Ray session "
                 "directory(ies) behind (now killed and removed):"]
        lines += [f"  process {text}" for text in processes] + [f"  directory {path}" for path in dirs]
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller reports and fails the run
        worker = getattr(session.config, "workerinput", {}).get("workerid", "worker")
        workeroutput["ballast_leftovers"] = [f"[{worker}] {line}" for line in lines]
        return
    lines += _session.pop("worker_lines", [])
    if not lines:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "leftovers", red=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print("\n".join(lines))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
