"""One worker class per deployment, and the weight sources a rollout worker is built with (no Ray, no engine).

Each class serves exactly the driver calls of its deployment, and refuses a spec naming other roles; a
rollout pool's source loads each export once, in version order, and a validation call never asks the
mailbox for newer weights.
"""

from types import SimpleNamespace

import pytest

from ballast.single_controller.decorator import registration_of
from ballast.workers import weight_sources
from ballast.workers.actor_rollout_ref import ActorRolloutRefWorker, RolloutWorker, TrainerWorker, _start
from ballast.workers.spec import GenerateArgs, WeightSyncSpec
from ballast.workers.weight_sources import UPDATE_WEIGHTS_METRIC, MailboxWeights, StoredExportWeights

ACTOR_CALLS = {"compute_log_prob", "compute_ref_log_prob", "update_actor", "save_checkpoint", "load_checkpoint",
               "export_hf", "actor_state_fingerprint"}


def _calls(cls) -> set:
    return {name for name in dir(cls) if registration_of(getattr(cls, name)) is not None} - {"init_model"}


def test_each_deployment_serves_exactly_its_calls():
    assert _calls(ActorRolloutRefWorker) == ACTOR_CALLS | {"generate_sequences"}
    assert _calls(TrainerWorker) == ACTOR_CALLS | {"export_weights"}
    assert _calls(RolloutWorker) == {"generate_sequences"}


@pytest.mark.parametrize("cls, actor, rollout", [(ActorRolloutRefWorker, True, False),
                                                 (TrainerWorker, True, True), (RolloutWorker, True, True)])
def test_a_spec_with_other_roles_is_refused_before_joining_the_group(cls, actor, rollout):
    spec = SimpleNamespace(actor=object() if actor else None, rollout=object() if rollout else None)
    worker = object.__new__(cls)
    with pytest.raises(ValueError, match=cls.__name__):
        _start(worker, spec, "its roles", actor=cls is not RolloutWorker, rollout=cls is not TrainerWorker)


class _Backend:
    def __init__(self):
        self.loads, self.awake = [], 0

    def wake_up(self):
        self.awake += 1

    def load_weights(self, named):
        named = list(named)
        self.loads.append(named)
        return len(named)


def _export(version, tensors=2):
    return SimpleNamespace(version=version, buckets=[[(f"w{i}", version) for i in range(tensors)]],
                           num_tensors=tensors, probe_log_probs=None)


def test_a_rollout_pool_loads_each_export_once_in_version_order(monkeypatch):
    monkeypatch.setattr(weight_sources, "iter_buckets", lambda buckets: (t for b in buckets for t in b))
    backend = _Backend()
    source = StoredExportWeights(backend, WeightSyncSpec(), rank=0)
    assert source.before(GenerateArgs(call_index=0)) == {} and backend.awake == 1  # nothing exported yet
    assert UPDATE_WEIGHTS_METRIC in source.before(GenerateArgs(call_index=1, weights=_export(3)))
    assert source.before(GenerateArgs(call_index=2, weights=_export(3))) == {}  # loaded mid-call before
    assert source.before(GenerateArgs(call_index=3, weights=_export(2))) == {}  # older than served
    assert [n[0][1] for n in backend.loads] == [3] and source.version == 3
    with pytest.raises(RuntimeError, match="loaded 1 of the 2"):
        bad = _export(4)
        bad.buckets = [bad.buckets[0][:1]]
        source.before(GenerateArgs(call_index=4, weights=bad))


def test_only_training_generations_look_into_the_mailbox():
    source = MailboxWeights(_Backend(), WeightSyncSpec(), rank=0, mailbox=object())
    assert source.during(GenerateArgs(call_index=0, validate=True)) is None
    assert source.during(GenerateArgs(call_index=0)).version == -1
    metrics = {}
    source.after(metrics)
    assert metrics == {"rollout/partial/weight_loads": [0.0], "rollout/served_version": [-1.0]}
