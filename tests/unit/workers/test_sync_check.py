"""The weight-sync check's verdicts and messages, on hand-made log-probs and stand-in engines."""

import contextlib

import pytest
import torch

from ballast.workers.sync_check import (
    DEFAULT_TOLERANCE,
    WeightSyncError,
    check_tolerance,
    compare,
    diagnose,
    probe_tokens,
    SyncCheck,
)

TRAINED = torch.tensor([-1.0, -2.0, -0.5, -3.0])
BASE = torch.tensor([-1.4, -1.5, -0.9, -2.6])  # the adapter moves the log-probs by 0.425 on average


class _Engine:
    """Stands in for a TrainEngine: log-probs with and without its adapter."""

    def __init__(self, adapter=True):
        self.adapter = object() if adapter else None
        self._off = False
        self.base_forwards = 0

    @contextlib.contextmanager
    def adapter_disabled(self):
        self._off = True
        yield
        self._off = False

    def probe_log_probs(self, tokens):
        self.base_forwards += self._off
        return BASE.clone() if self._off else TRAINED.clone()


class _Backend:
    def __init__(self, served):
        self.served = served

    def prompt_log_probs(self, sequences):
        return [self.served.clone() for _ in sequences]


def test_probe_is_fixed_and_in_range():
    assert probe_tokens(50) == probe_tokens(50) and len(probe_tokens(50)) == 16
    assert all(0 <= t < 50 for t in probe_tokens(50, length=200))
    with pytest.raises(ValueError):
        probe_tokens(1)


def test_tolerance_defaults_to_the_least_precise_dtype():
    assert check_tolerance(None, "float32", "float32") == DEFAULT_TOLERANCE["float32"]
    assert check_tolerance(None, "float32", "bfloat16") == DEFAULT_TOLERANCE["bfloat16"]
    assert check_tolerance(0.2, "float32") == 0.2


def test_a_synced_adapter_passes_and_reports_how_conclusive_it_was():
    metrics = SyncCheck((1, 2, 3, 4, 5), 1e-3).run(_Backend(TRAINED + 1e-6), _Engine(), "the adapter weights")
    assert metrics["rollout/sync_check/mean_abs_diff"] == pytest.approx(1e-6, abs=1e-7)
    assert metrics["rollout/sync_check/adapter_effect"] == pytest.approx(0.425)
    assert metrics["rollout/sync_check/served_vs_base"] == pytest.approx(0.425, abs=1e-5)


def test_the_frozen_base_is_scored_once():
    check, engine = SyncCheck((1, 2, 3), 1e-3), _Engine()
    for _ in range(3):
        assert check.run(_Backend(TRAINED), engine, "the adapter weights")["rollout/sync_check/adapter_effect"] > 0.4
    assert engine.base_forwards == 1


def test_serving_the_base_model_fails_naming_the_cause():
    with pytest.raises(WeightSyncError, match="sampling from the base model, the trained adapter did not reach it"):
        SyncCheck((1, 2, 3, 4, 5), 1e-3).run(_Backend(BASE), _Engine(), "the adapter weights")


def test_stale_weights_and_full_weight_runs_fail_too():
    stale = TRAINED + 0.2  # neither the trained actor nor the base
    with pytest.raises(WeightSyncError, match="neither the trained actor nor the base model"):
        SyncCheck((1, 2, 3), 1e-3).run(_Backend(stale), _Engine(), "the adapter weights")
    with pytest.raises(WeightSyncError, match="weights other than the trained ones"):
        SyncCheck((1, 2, 3), 1e-3).run(_Backend(stale), _Engine(adapter=False), "the full weights")
    assert diagnose(compare(TRAINED, TRAINED, None), 1e-3, "x") is None
    nan = compare(torch.full((4,), float("nan")), TRAINED, None)
    assert diagnose(nan, 1e-3, "x") is not None  # a NaN is never a pass
