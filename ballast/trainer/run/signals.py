"""SIGTERM and SIGINT on the driver: stop like Ctrl-C, or finish the step and save first.

SIGTERM is what Slurm, Kubernetes and `ray job stop` send. Left alone, Ray's C++ signal handler
(installed by `ray.init`) aborts the driver with a stack dump and exit 134, skipping Python cleanup.
`install()` puts a Python handler in its place (`reinstall()` after `ray.init`, which replaces
handlers):

* `trainer.save_on_signal=false` (default): the signal raises `Terminated` (SIGTERM) or
  `KeyboardInterrupt` (SIGINT) at once, wherever the driver is; the run stops, its workers and its
  local Ray are shut down, and the newest complete checkpoint stays as it was (saves are atomic).
* `trainer.save_on_signal=true`: the first signal only sets a flag; the training loop finishes the
  current step, saves a checkpoint and then raises. A second signal stops at once.

The command line turns `Terminated` into `ballast: terminated` and exit code 143 (128 + SIGTERM).
"""

from __future__ import annotations

import signal
from typing import Optional

EXIT_TERMINATED = 128 + signal.SIGTERM

_state = {"save_first": False, "pending": None, "last": None, "installed": False}


class Terminated(KeyboardInterrupt):
    """The driver got SIGTERM. A KeyboardInterrupt subclass so that every cleanup path Ctrl-C takes
    (and no `except Exception`) sees it too."""


def _handler(signum, frame) -> None:
    _state["last"] = signum
    if _state["save_first"] and _state["pending"] is None:
        _state["pending"] = signum
        return
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def install(save_first: bool = False) -> None:
    """Handle SIGTERM and SIGINT as described in the module docstring (main thread only)."""
    _state.update(save_first=save_first, installed=True)
    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def reinstall() -> None:
    """Put the handlers back after `ray.init` replaced them, if `install` was called (by the command line)."""
    if _state["installed"]:
        install(_state["save_first"])


def uninstall(exiting: bool = False) -> None:
    """Back to the defaults. `exiting`: the process ends next (the command line, its outcome decided),
    so a SIGTERM from now on is ignored: under the default action it would kill the process during
    interpreter teardown, with no `ballast:` line and a signal instead of the run's exit code."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN if exiting else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _state.update(save_first=False, pending=None, last=None, installed=False)


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
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
