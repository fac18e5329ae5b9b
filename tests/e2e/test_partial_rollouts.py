"""A rollout pool that fails to start, with partial rollouts on (separate_async, one batch ahead), is
cleaned up: the error names the cause, and the failed start leaves no placement group (nor the actors
placed in it) behind that would refuse the next session in the process. (Partial rollouts that train,
weights loaded mid-call: the matrix rows of tests/e2e/test_rollout_matrix.py.)"""

import pytest
import ray.util

from ballast.single_controller.errors import WorkerError
from testkit.e2e import SPLIT_POOLS


def _live_placement_groups() -> set:
    return {pg for pg, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"}


def test_a_rollout_pool_that_fails_to_start_leaves_nothing_behind(session, tmp_path, monkeypatch):
    # a loop module the driver can import (it checks the config at start-up) but the workers cannot
    (tmp_path / "driver_only_loops.py").write_text("from testkit.agent import WaitingLoop as Loop\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = tmp_path / "broken.yaml"
    broken.write_text("- name: waiting\n  _target_: driver_only_loops.Loop\n")
    extra = [*SPLIT_POOLS, "trainer.v1.separate_async.num_warmup_batches=1",
             f"actor_rollout_ref.rollout.agent.agent_loop_config_path={broken}",
             "actor_rollout_ref.rollout.agent.default_agent_loop=waiting"]
    before = _live_placement_groups()
    with pytest.raises(WorkerError, match="cannot import module 'driver_only_loops'"):
        with session("broken", *extra):
            pass
    assert _live_placement_groups() <= before
