"""Test-only: breaks the actor -> rollout adapter sync on purpose, in every Python process of a run
whose PYTHONPATH starts with this folder (Python imports `sitecustomize` at start-up, and a run's Ray
workers inherit the driver's PYTHONPATH).

When a rollout backend module is imported, its `load_adapter` (or, with BALLAST_TEST_BREAK_SYNC=
load_weights, its `load_weights`) is replaced by one that consumes the tensors it is given (a gather
is a collective: every rank must still run it) and loads nothing, so the rollout engine keeps serving
what it served before: exactly the silent failure the weight-sync check exists to catch. The patch is applied lazily, from an import hook, so processes that never import
the backends (Ray's own helpers) stay untouched.
"""

import importlib.abc
import importlib.util
import os
import sys

TARGETS = {"ballast.workers.rollout.vllm_backend": "VLLMBackend", "ballast.workers.rollout.hf_backend": "HFBackend"}


METHOD = os.environ.get("BALLAST_TEST_BREAK_SYNC", "load_adapter")


def _load_nothing(self, named_tensors, peft_config=None):
    return sum(1 for _ in named_tensors)


class _BreakSync(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            setattr(getattr(module, TARGETS[name]), METHOD, _load_nothing)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _BreakSync())
