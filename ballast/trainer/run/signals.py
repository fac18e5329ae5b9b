"""SIGTERM and SIGINT on the driver: stop like Ctrl-C, or finish the step and save first; and a
shutdown that no later signal can cut short, with a hard deadline.

SIGTERM is what Slurm, Kubernetes and `ray job stop` send. Left alone, Ray's C++ signal handler
(installed by `ray.init`) aborts the driver with a stack dump and exit 134, skipping Python cleanup.
`install()` puts a Python handler in its place (`reinstall()` after `ray.init`, which replaces
handlers):

* `trainer.save_on_signal=false` (default): the signal raises `Terminated` (SIGTERM) or
  `KeyboardInterrupt` (SIGINT) at once, wherever the driver is; the run stops, its workers and its
  local Ray are shut down, and the newest complete checkpoint stays as it was (saves are atomic).
* `trainer.save_on_signal=true`: the first signal only sets a flag; the training loop finishes the
  current step, saves a checkpoint and then raises. A second signal stops at once.

Once the run is stopping (a signal raised, or `begin_shutdown()` after a failure), every further
signal is only noted on stderr: an exception raised in the middle of the cleanup would skip the rest
of it (workers, Ray's processes, its session directory) and turn the exit code into 1. What bounds the
cleanup instead is `shutdown_deadline`: past it, what the run started is killed and the process exits
with the code the run had earned. The command line turns `Terminated` into `ballast: terminated` and
exit code 143 (128 + SIGTERM), Ctrl-C into `ballast: interrupted` and 130.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Iterator, Optional

EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_INTERRUPTED = 128 + signal.SIGINT
SHUTDOWN_DEADLINE_S = 30.0  # stopping workers and a local Ray takes 1-5 s; past this something hangs

_state = {"save_first": False, "exiting": False, "pending": None, "last": None, "installed": False,
          "stopping": False, "deadline_s": SHUTDOWN_DEADLINE_S}


class Terminated(KeyboardInterrupt):
    """The driver got SIGTERM. A KeyboardInterrupt subclass so that every cleanup path Ctrl-C takes
    (and no `except Exception`) sees it too."""


def _say(line: str) -> None:
    # os.write, not print: the handler may interrupt a print in progress (a buffered stream is not reentrant)
    try:
        os.write(2, f"ballast: {line}\n".encode())
    except OSError:
        pass


def _handler(signum, frame) -> None:
    if _state["stopping"]:
        _say(f"already stopping; {signal.Signals(signum).name} noted (the run's processes are being shut "
             f"down, killed after {_state['deadline_s']:g}s at most)")
        return
    _state["last"] = signum
    if _state["save_first"] and _state["pending"] is None:
        _state["pending"] = signum
        return
    _state["stopping"] = True
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def install(save_first: bool = False, exiting: bool = False) -> None:
    """Handle SIGTERM and SIGINT as described in the module docstring (main thread only). `exiting`:
    the process ends when the run does (the command line), so a shutdown stuck past its deadline
    ends the process; otherwise (a library caller) it only kills what the run started."""
    _state.update(save_first=save_first, exiting=exiting, installed=True, pending=None, last=None, stopping=False)
    _register()


def _register() -> None:
    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def reinstall() -> None:
    """Put the handlers back after `ray.init` replaced them, if `install` was called (by the command line)."""
    if _state["installed"]:
        _register()


def begin_shutdown() -> None:
    """The run is stopping (whatever the cause): from now on a signal is noted, never raised."""
    _state["stopping"] = True


def uninstall(exiting: bool = False) -> None:
    """Back to the defaults. `exiting`: the process ends next (the command line, its outcome decided),
    so SIGTERM and SIGINT are ignored from now on: the default actions would kill the process during
    interpreter teardown, with no `ballast:` line and a signal or a traceback instead of the run's
    exit code."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN if exiting else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN if exiting else signal.default_int_handler)
    _state.update(save_first=False, exiting=False, pending=None, last=None, installed=False, stopping=False)


def was_terminated(err: BaseException) -> bool:
    """Whether `err` stands for a SIGTERM. Ray turns an exception raised by a signal handler during
    `ray.get`/`ray.wait` into a new plain KeyboardInterrupt, so the class alone cannot tell."""
    return isinstance(err, Terminated) or (isinstance(err, KeyboardInterrupt) and _state["last"] == signal.SIGTERM)


def pending() -> Optional[int]:
    """The signal that asked the loop to stop after this step (save_on_signal), or None."""
    return _state["pending"]


def raise_pending() -> None:
    """Raise what the pending signal stands for (called by the loop once it is at a safe point)."""
    signum = _state["pending"]
    _state["pending"] = None
    if signum is not None:
        _state["stopping"] = True
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


@contextlib.contextmanager
def shutdown_deadline(seconds: float, on_expiry: Callable[[], object], exit_code: int,
                      last_line: str) -> Iterator[None]:
    """Run the block (a run's cleanup) in stopping mode; if it has not finished after `seconds`, call
    `on_expiry` (kill what the run started) from a helper thread, and, when the process exits with the
    run (`install(exiting=True)`: the command line), print `last_line` and end the process with
    `exit_code`, whatever the block is waiting on."""
    begin_shutdown()
    _state["deadline_s"] = seconds
    exit_process = _state["exiting"]
    done = threading.Event()

    def expire() -> None:
        if done.wait(seconds):
            return
        _say(f"shutdown did not finish within {seconds:g}s; killing what the run started")
        try:
            on_expiry()
        except BaseException as err:  # nothing may keep the process from ending now
            _say(f"while killing: {type(err).__name__}: {err}")
        if exit_process:
            if last_line:
                _say(last_line.removeprefix("ballast: "))
            os._exit(exit_code)

    watcher = threading.Thread(target=expire, name="ballast-shutdown-deadline", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
