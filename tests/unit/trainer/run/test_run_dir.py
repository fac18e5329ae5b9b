"""One run per run directory: a second run is refused while the first holds the lock (naming its pid
and host), the lock dies with its process (kill -9 included), and a fresh start on top of an old run
is refused unless the old run is explicitly moved aside."""

import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from ballast.trainer.config import load_config
from ballast.trainer.run.preflight import refuse_early
from ballast.trainer.run.run_dir import (
    LOCK_FILE, RunDirError, check_fresh_start, check_not_busy, lock_run_dir, run_contents, starts_fresh_here,
)

from testkit.e2e import overrides

_HOLDER = """
import sys, time
from ballast.trainer.run.run_dir import lock_run_dir
lock_run_dir(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def _old_run(run_dir):
    os.makedirs(os.path.join(run_dir, "global_step_2"))
    for name, text in (("metrics.jsonl", '{"step": 1}\n{"step": 2}\n'), ("config.json", "{}"),
                       ("latest_checkpointed_iteration.txt", "2")):
        with open(os.path.join(run_dir, name), "w") as f:
            f.write(text)


def test_second_run_is_refused_naming_the_holder_and_the_lock_dies_with_its_process(tmp_path):
    run_dir = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, run_dir], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        assert holder.stdout.readline().strip() == "locked"
        busy = rf"default_local_dir='{run_dir}' is in use by another run \(pid {holder.pid} on host {socket.gethostname()} since "
        with pytest.raises(RunDirError, match=busy):
            lock_run_dir(run_dir)
        with pytest.raises(RunDirError, match=busy):  # the early check, before the data is read, says the same
            check_not_busy(run_dir)
        holder.send_signal(signal.SIGKILL)  # no cleanup code runs: the kernel drops the lock
        holder.wait(timeout=30)
    finally:
        holder.kill()
    check_not_busy(run_dir)  # a lock file nobody holds is no obstacle, and the probe leaves it unheld
    lock = lock_run_dir(run_dir)
    assert open(os.path.join(run_dir, LOCK_FILE)).read().startswith(f"pid {os.getpid()} on host ")
    with pytest.raises(RunDirError, match="in use by another run"):  # one lock per run, also in one process
        lock_run_dir(run_dir)
    lock.release()
    lock_run_dir(run_dir).release()


def test_fresh_start_on_top_of_an_old_run_is_refused_with_the_ways_out(tmp_path):
    run_dir = str(tmp_path / "run")
    _old_run(run_dir)
    assert run_contents(run_dir) == ["config.json", "global_step_2", "latest_checkpointed_iteration.txt",
                                     "metrics.jsonl"]
    with pytest.raises(RunDirError, match=r"already holds a run \(config\.json, global_step_2, .*\) and "
                                          r"trainer\.resume_mode='disable' would start a new one .*new "
                                          r"trainer\.default_local_dir.*resume_mode=auto.*move_old_run_aside=true"):
        check_fresh_start(run_dir, "disable", None, move_old_run_aside=False)
    assert open(os.path.join(run_dir, "metrics.jsonl")).read().count("step") == 2  # untouched
    # continuing from a checkpoint of the directory is not a fresh start; from another directory's it is
    assert check_fresh_start(run_dir, "auto", os.path.join(run_dir, "global_step_2"), False) is None
    assert not starts_fresh_here(os.path.join(run_dir, "global_step_2"), run_dir)
    assert not starts_fresh_here(os.path.join(run_dir, "global_step_2") + "/", run_dir)
    assert starts_fresh_here(None, run_dir)
    with pytest.raises(RunDirError, match="would start a new one"):
        check_fresh_start(run_dir, "resume_path", str(tmp_path / "other" / "global_step_5"), False)
    with pytest.raises(RunDirError, match="but no complete checkpoint to continue it from, and trainer.resume_mode='auto'"):
        check_fresh_start(run_dir, "auto", None, False)  # auto found nothing to continue from
    # a new or empty directory is fine
    assert check_fresh_start(str(tmp_path / "new"), "disable", None, False) is None


def _trainer_section(run_dir, *extra):
    paths = {"model": "/m", "train": "/t.parquet", "val": "/v.parquet"}  # never read: only `trainer` is checked
    return load_config(overrides(paths, run_dir, *extra)).trainer


def test_the_early_check_refuses_what_the_claim_would_and_touches_nothing(tmp_path):
    new = str(tmp_path / "new")
    refuse_early(_trainer_section(new))
    assert not os.path.exists(new), "the early check must not create the run directory"
    run_dir = str(tmp_path / "run")
    _old_run(run_dir)
    before = sorted(os.listdir(run_dir))
    with pytest.raises(RunDirError, match="already holds a run"):
        refuse_early(_trainer_section(run_dir, "trainer.resume_mode=disable"))
    # continuing the run, or moving it aside, is decided under the lock once the data has been read
    refuse_early(_trainer_section(run_dir, "trainer.resume_mode=auto"))
    refuse_early(_trainer_section(run_dir, "trainer.resume_mode=disable", "trainer.move_old_run_aside=true"))
    assert sorted(os.listdir(run_dir)) == before


def test_move_old_run_aside_keeps_it_whole_in_a_sibling_directory(tmp_path):
    run_dir = str(tmp_path / "run")
    _old_run(run_dir)
    lock = lock_run_dir(run_dir)
    moved = check_fresh_start(run_dir, "disable", None, move_old_run_aside=True)
    lock.release()
    assert os.path.dirname(moved) == str(tmp_path) and os.path.basename(moved).startswith("run.old-")
    assert sorted(os.listdir(moved)) == ["config.json", "global_step_2", "latest_checkpointed_iteration.txt",
                                         "metrics.jsonl"]
    assert os.listdir(run_dir) == [LOCK_FILE] and run_contents(run_dir) == []
    _old_run(run_dir)
    assert check_fresh_start(run_dir, "disable", None, True) not in (moved, None)


def _unwritable_dir(tmp_path):
    """A directory this process cannot write into: read-only for a normal user; root writes anywhere on
    an ordinary file system, so for root a directory of the kernel's read-only sysfs."""
    if os.geteuid() == 0:
        return "/sys/kernel"
    path = tmp_path / "read_only"
    path.mkdir()
    path.chmod(0o555)
    return str(path)


@pytest.mark.parametrize("kind", ["a file", "under a file", "read-only", "a NUL byte"])
def test_unusable_run_directory_is_exit_2_naming_the_setting(tmp_path, kind):
    from ballast.trainer.main import EXIT_BAD_INPUT, failure

    (tmp_path / "file").write_text("not a directory")
    run_dir = {"a file": str(tmp_path / "file"), "under a file": str(tmp_path / "file" / "run"),
               "read-only": _unwritable_dir(tmp_path), "a NUL byte": str(tmp_path / "bad\0name")}[kind]
    reason = {"a file": r"it is a file, not a directory", "under a file": r"Not a directory",
              "read-only": r"(Permission denied|Read-only file system|Operation not permitted)",
              "a NUL byte": r"embedded null byte"}[kind]
    with pytest.raises(RunDirError, match=rf"trainer\.default_local_dir={re.escape(repr(run_dir))} cannot hold a run: "
                                          rf".*{reason}.*; point trainer\.default_local_dir at a writable directory"
                       ) as info:
        lock_run_dir(run_dir)
    code, line = failure(info.value)
    assert code == EXIT_BAD_INPUT and line.startswith("run directory: trainer.default_local_dir=")
    assert (tmp_path / "file").read_text() == "not a directory"
