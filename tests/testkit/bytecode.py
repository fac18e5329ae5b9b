"""Compile the package's bytecode once, before the suite starts its processes.

Every Ray worker, trainer subprocess and spawned rank imports ballast afresh; with no bytecode on
disk each of them compiles its ~20k lines of source again (about a second of CPU per process on the
2-core box). Python writes that cache itself on the first import unless PYTHONDONTWRITEBYTECODE is
set, as container images often do; compiling explicitly here gives every process of the suite the
cache either way. The files go to the usual `__pycache__` directories (ignored by git) and are only
rewritten when a source changes.
"""

import compileall
import importlib.util
import os

_TESTKIT = os.path.dirname(os.path.abspath(__file__))


def compile_sources() -> None:
    """Bytecode for the ballast package the processes will import (found the way they find it) and
    for the test helpers the workers import."""
    spec = importlib.util.find_spec("ballast")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots + [_TESTKIT]:
        compileall.compile_dir(root, quiet=1, workers=1)


def pytest_configure(config):
    """Once per run: in the controlling process of an xdist run (before its workers start) or in the
    only process of a plain one."""
    if not hasattr(config, "workerinput"):
        compile_sources()
