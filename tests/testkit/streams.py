"""How the suite is split between two pytest-xdist workers (`scripts/test.sh` runs `pytest -n 2`).

Each test belongs to a group, and a group runs whole on one worker, in collection order. The heavy
tests form two streams of about equal length on 2 cores that overlap each other's idle time (process
and Ray start-ups, waits on subprocesses and collectives); each unit-test file is a group of its own,
so those files fill in wherever a worker is free and keep their module fixtures on one worker. The two
real-model tests (~10 GB each) share a stream, so they never run at once.

The groups come from the test's path, through a scheduler of our own (pytest-xdist's `loadgroup`
mode, which reads `xdist_group` marks, does not group anything under pytest 9).
"""

import pytest

_STREAMS = (  # (path prefix, stream); the first match wins
    ("tests/distributed/test_real_model_ulysses.py", "stream-e2e"),
    ("tests/e2e/test_faults.py", "stream-cluster"),
    ("tests/e2e/test_bad_inputs.py", "stream-cluster"),
    ("tests/e2e/test_split_pools_ahead.py", "stream-cluster"),
    ("tests/e2e/test_partial_rollouts.py", "stream-cluster"),
    ("tests/e2e/test_split_pools_resume_after_kill.py", "stream-cluster"),
    ("tests/e2e/test_rollout_correction_runs.py", "stream-cluster"),
    ("tests/e2e/", "stream-e2e"),
    ("tests/distributed/", "stream-cluster"),
    ("tests/multinode/", "stream-cluster"),
    ("tests/ray/", "stream-cluster"),
)


def group_of(nodeid: str) -> str:
    """The group of a test from its node id (`tests/dir/test_file.py::test_name[...]`)."""
    path = nodeid.split("::", 1)[0]
    return next((stream for prefix, stream in _STREAMS if path.startswith(prefix)), path)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown (and unused) without it
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (pytest-xdist's default `--dist load`): schedule by group_of; another --dist is left alone."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class StreamScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False  # collection order: both streams start first, one per worker
    return StreamScheduling(config, log)
