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
