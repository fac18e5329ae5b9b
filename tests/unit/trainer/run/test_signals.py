"""The driver's signal handling without Ray: SIGTERM raises `Terminated` (exit 143 on the command
line), SIGINT stays a KeyboardInterrupt; with save-first the first signal only asks the loop to stop
after its step and a second stops at once; a plain KeyboardInterrupt re-raised by Ray after a SIGTERM
still counts as a termination."""

import os
import signal

import pytest

from ballast.trainer.run import signals
@pytest.fixture(autouse=True)
def _restore():
    yield
    signals.uninstall()


def test_sigterm_raises_terminated_and_sigint_a_keyboard_interrupt():
    signals.install(save_first=False)
    with pytest.raises(signals.Terminated) as info:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0.01)  # let the interpreter run the handler
    assert signals.was_terminated(info.value) and signals.EXIT_TERMINATED == 143
    signals.install(save_first=False)
    with pytest.raises(KeyboardInterrupt) as info:
        os.kill(os.getpid(), signal.SIGINT)
        signal.sigtimedwait([], 0.01)
    assert not isinstance(info.value, signals.Terminated) and not signals.was_terminated(info.value)


def test_save_first_defers_the_first_signal_and_a_second_stops_at_once():
    signals.install(save_first=True)
    os.kill(os.getpid(), signal.SIGTERM)
    signal.sigtimedwait([], 0.01)
    assert signals.pending() == signal.SIGTERM  # nothing raised: the loop saves at its next safe point
    with pytest.raises(signals.Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0.01)
    with pytest.raises(signals.Terminated):
        signals.raise_pending()
    signals.raise_pending()  # nothing pending any more: a no-op


def test_a_plain_keyboard_interrupt_after_sigterm_counts_as_terminated():
    signals.install(save_first=False)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0.01)
    except signals.Terminated:
        pass
    assert signals.was_terminated(KeyboardInterrupt())  # what Ray raises in place of the handler's exception
    signals.uninstall()
    assert not signals.was_terminated(KeyboardInterrupt())


def test_a_sigterm_after_the_command_line_run_ended_is_ignored_not_fatal():
    # between the end of the run and the end of the process (lock release, interpreter teardown) a
    # SIGTERM under the default action would kill the process with no line and a signal for exit code
    signals.install(save_first=False)
    signals.uninstall(exiting=True)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGTERM)
    signal.sigtimedwait([], 0.01)  # survives
    signals.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _signal_self(signum):
    os.kill(os.getpid(), signum)
    signal.sigtimedwait([], 0.01)


@pytest.mark.parametrize("first, second", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGTERM),
                                           (signal.SIGTERM, signal.SIGINT)])
def test_once_stopping_further_signals_are_noted_and_cannot_cut_the_shutdown_short(first, second, capfd):
    signals.install(save_first=False)
    with pytest.raises(KeyboardInterrupt) as info:
        _signal_self(first)
    for _ in range(3):  # the shutdown that follows runs to its end, however many signals arrive
        _signal_self(second)
    assert signals.was_terminated(info.value) == (first == signal.SIGTERM)  # the first signal decides the exit code
    assert signals.was_terminated(KeyboardInterrupt()) == (first == signal.SIGTERM)
    assert "ballast: already stopping" in capfd.readouterr().err


def test_a_signal_during_the_shutdown_after_a_failure_is_noted_not_raised():
    signals.install(save_first=False)
    signals.begin_shutdown()  # e.g. a worker died and the run is now stopping its workers and Ray
    _signal_self(signal.SIGINT)
    _signal_self(signal.SIGTERM)
    assert not signals.was_terminated(KeyboardInterrupt())


def test_save_first_then_a_second_signal_stops_and_a_third_is_noted():
    signals.install(save_first=True)
    _signal_self(signal.SIGTERM)
    with pytest.raises(signals.Terminated):
        _signal_self(signal.SIGTERM)
    _signal_self(signal.SIGINT)  # noted: the run is already stopping
    assert signals.was_terminated(KeyboardInterrupt())


def test_an_exiting_command_line_ignores_both_signals():
    signals.install(save_first=False)
    signals.uninstall(exiting=True)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    signals.uninstall()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


_STUCK_SHUTDOWN = """
import subprocess, sys, time
from ballast.trainer.run import signals
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
signals.install(exiting=True)
with signals.shutdown_deadline(float(sys.argv[1]), on_expiry=child.kill, exit_code=130, last_line="ballast: interrupted"):
    time.sleep(120)  # a shutdown step that never returns (a hung ray.shutdown, a stuck upload)
"""


def test_a_stuck_shutdown_is_ended_at_the_deadline_killing_what_the_run_started(tmp_path):
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _STUCK_SHUTDOWN, "1.5"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    child = int(proc.stdout.readline())
    # Timed from here: the interpreter's start-up and imports (slow on a loaded box) are not the shutdown's;
    # without the deadline the stuck step alone would take 120 s.
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and time.monotonic() - start < 30, err
    lines = err.strip().splitlines()
    assert lines[-1] == "ballast: interrupted", err
    assert "shutdown did not finish within 1.5s" in err
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z", \
        "the deadline must kill what the run started"
