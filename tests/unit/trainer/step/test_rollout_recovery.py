"""Rollout recovery on a fake worker group: one replacement per failure however many calls were in
flight, every call run again once in its own order with its own weights, the bound, what counts."""

import pytest

from ballast.single_controller import WorkerDiedError, WorkerError, WorkerTimeoutError
from ballast.trainer.config.schema.trainer import RolloutRecoveryConfig
from ballast.trainer.step.rollout_recovery import RolloutFailedError, RolloutRecovery, recoverable


class FakeGroup:
    """Workers that fail every call submitted to generation `doomed` with `error`."""

    world_size = 2

    def __init__(self, doomed=0, error=None):
        self.generation, self.doomed = 0, doomed
        self.error = error or WorkerDiedError("rollout.generate_sequences: worker rank 1 died")
        self.log = []  # (generation, call name, weights) of every submission, in order

    def respawn(self):
        self.generation += 1
        return [101, 102]

    def ping(self, timeout_s):
        return [{}, {}]

    def submit(self, name, weights):
        self.log.append((self.generation, name, weights))
        return FakeFuture(self, name, self.generation)


class FakeFuture:
    def __init__(self, group, name, generation):
        self.group, self.name, self.generation = group, name, generation

    def get(self, timeout_s=None):
        if self.generation == self.group.doomed:
            raise self.group.error
        return FakeOutput(f"{self.name}@g{self.generation}")


class FakeOutput(str):
    """A generation's result: its name, and the metrics the recovery adds."""

    def __new__(cls, name):
        out = super().__new__(cls, name)
        out.metrics = {}
        return out


def _recovery(group, max_restarts=3):
    inits = []
    rec = RolloutRecovery(group, inits.append, RolloutRecoveryConfig(max_restarts, None, 5.0))
    return rec, inits


def _submit(rec, group, name, weights):
    # the first submission carries only a pending export; the repeat carries the call's own weights
    return rec.submit(lambda: group.submit(name, None), lambda: group.submit(name, weights))


def test_one_failure_replaces_once_and_runs_every_call_in_flight_again_in_order():
    group = FakeGroup()
    rec, inits = _recovery(group)
    calls = [_submit(rec, group, f"step{s}", f"v{s - 1}") for s in (3, 4, 5)]  # two batches ahead
    outs = [c.get() for c in calls]
    assert outs == ["step3@g1", "step4@g1", "step5@g1"]
    assert rec.restarts == 1 and inits == [group]
    # each call once on the new workers, in launch order, each with the weights it was launched under
    assert group.log[3:] == [(1, "step3", "v2"), (1, "step4", "v3"), (1, "step5", "v4")]
    # the replacement is counted once, on the call whose failure caused it
    assert [o.metrics["rollout/recoveries"] for o in outs] == [[1.0], [0.0], [0.0]]
    assert outs[0].metrics["timing_s/rollout_recovery"][0] >= 0


def test_a_call_submitted_after_the_replacement_is_not_run_twice():
    group = FakeGroup()
    rec, _ = _recovery(group)
    first = _submit(rec, group, "step1", "v0")
    assert first.get() == "step1@g1"
    later = _submit(rec, group, "step2", "v1")
    assert later.get() == "step2@g1"
    assert [entry[1] for entry in group.log] == ["step1", "step1", "step2"]


@pytest.mark.parametrize("error", [WorkerTimeoutError("rank(s) [0] did not finish within 5s"),
                                   WorkerError("rollout.generate_sequences failed on worker rank 0:\n"
                                               "ballast.workers.rollout.faults.RolloutEngineError: engine died")])
def test_a_hang_and_an_engine_error_are_recovered(error):
    group = FakeGroup(error=error)
    rec, _ = _recovery(group)
    assert recoverable(error)
    assert _submit(rec, group, "step1", "v0").get() == "step1@g1"


def test_any_other_worker_error_stops_the_run_without_a_replacement():
    group = FakeGroup(error=WorkerError("rollout.generate_sequences failed on worker rank 0:\nKeyError: 'prompt'"))
    rec, inits = _recovery(group)
    with pytest.raises(WorkerError, match="KeyError"):
        _submit(rec, group, "step1", "v0").get()
    assert rec.restarts == 0 and inits == [] and group.generation == 0


def test_past_max_restarts_the_run_stops_naming_the_key_and_the_worker():
    group = FakeGroup()
    group.doomed = None
    rec, _ = _recovery(group, max_restarts=1)
    for doomed in (0, 1):  # the original workers fail, then their replacements
        group.doomed = doomed
        call = _submit(rec, group, f"step{doomed}", "v")
        if doomed == 0:
            assert call.get() == "step0@g1"
    with pytest.raises(RolloutFailedError, match=r"max_restarts=1 allows: .*worker rank 1 died"):
        call.get()
