"""The weight-sync check: its probe, its calibrated tolerance, and its verdicts on stand-in engines.

The stand-ins model what a real pair of engines does: the rollout engine's log-probs are the weights'
log-probs plus a fixed rounding noise (`GAP` on average, a different draw after every load), the actor's
are exact; an adapter (or an update) moves every log-prob of the probe by its own small amount.
"""

import contextlib

import pytest
import torch

from ballast.models import load_tokenizer, tiny_model_dir
from ballast.workers.sync_check import (
    CALIBRATION_CEILING, PROBE_MESSAGES, TOLERANCE_FLOOR, TOLERANCE_MARGIN, WeightSyncError, calibrated_tolerance,
    calibration_error, compare, diagnose, probe_tokens, SyncCheck,
)

N = 64
BASE = -3.0 + torch.linspace(-1, 1, N)
DIRECTION = torch.sign(torch.sin(torch.arange(N) + 0.5))  # how an update moves each log-prob
GAP = 0.01  # a bf16 engine's rounding gap (SmolLM2 on CPU: 0.04)


def _noise(draw: int, size: float = GAP) -> torch.Tensor:
    g = torch.Generator().manual_seed(draw)
    return size * torch.sign(torch.randn(N, generator=g)) * (0.5 + torch.rand(N, generator=g))  # mean |.| = size


class _Actor:
    """A TrainEngine stand-in: `shift` moves its log-probs along DIRECTION (the adapter / the updates)."""

    def __init__(self, lora=True):
        self.adapter = object() if lora else None
        self.shift, self._off, self.base_forwards = 0.0, False, 0

    @contextlib.contextmanager
    def adapter_disabled(self):
        self._off = True
        yield
        self._off = False

    def probe_log_probs(self, tokens):
        assert len(tokens) == N + 1
        self.base_forwards += self._off
        return BASE.clone() if self._off else BASE + self.shift * DIRECTION


class _Engine:
    """A rollout engine stand-in: serves `shift` (what reached it) with a new rounding draw per load."""

    def __init__(self, gap=GAP):
        self.shift, self.gap, self.loads = 0.0, gap, 0

    def load(self, shift):
        self.shift, self.loads = shift, self.loads + 1

    def prompt_log_probs(self, sequences):
        return [BASE + self.shift * DIRECTION + _noise(self.loads, self.gap) for _ in sequences]


TOKENS = tuple(range(N + 1))


def _calibrated(actor, engine, configured=None, dtype="bfloat16"):
    check = SyncCheck(TOKENS, configured, dtype, "float32")
    check.calibrate_colocated(engine, actor)
    return check


# ----------------------------------------------------------------------------- the probe
def test_the_probe_is_a_fixed_conversation_in_the_models_chat_template():
    tokenizer = load_tokenizer(tiny_model_dir())
    tokens = probe_tokens(tokenizer, len(tokenizer), max_tokens=400)
    assert tokens == probe_tokens(tokenizer, len(tokenizer), max_tokens=400)  # the same on every rank
    text = tokenizer.decode(list(tokens))
    assert PROBE_MESSAGES[0]["content"] in text and PROBE_MESSAGES[1]["content"] in text
    assert text == tokenizer.apply_chat_template(list(PROBE_MESSAGES), tokenize=False)
    assert probe_tokens(tokenizer, len(tokenizer), max_tokens=16) == tokens[:16]  # cut to the engine's context
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        probe_tokens(tokenizer, 10)
    with pytest.raises(ValueError, match="needs 2"):
        probe_tokens(tokenizer, len(tokenizer), max_tokens=1)


# ----------------------------------------------------------------------------- calibration
def test_the_tolerance_is_a_margin_over_the_start_up_gap_with_a_floor():
    assert calibrated_tolerance(0.04, "bfloat16", "float32") == pytest.approx(TOLERANCE_MARGIN * 0.04)
    assert calibrated_tolerance(0.0, "float32") == TOLERANCE_FLOOR["float32"]  # identical kernels: 0
    assert calibrated_tolerance(1e-7, "float32", "bfloat16") == TOLERANCE_FLOOR["bfloat16"]  # least precise
    assert calibration_error(0.04, None, "bfloat16") is None
    assert "more than 0.01, the most rounding explains in float32" in calibration_error(0.5, None, "float32")
    assert calibration_error(float("nan"), None, "float32") is not None
    assert "weight_sync_check_tolerance=0.01" in calibration_error(0.02, 0.01, "bfloat16")  # configured: the limit


def test_calibration_sets_the_tolerance_from_the_measured_gap_and_scores_the_base_once():
    actor, engine = _Actor(), _Engine()
    check = _calibrated(actor, engine)
    assert check.start_gap == pytest.approx(GAP, rel=0.1)
    assert check.tolerance == pytest.approx(TOLERANCE_MARGIN * check.start_gap)
    for step in range(1, 4):
        actor.shift = 0.05 * step
        engine.load(actor.shift)
        check.run(engine, actor, "the adapter weights")
    assert actor.base_forwards == 1  # the frozen base, at start-up only


def test_a_start_up_gap_beyond_rounding_stops_the_run_before_any_update():
    # e.g. the engine loaded another checkpoint than the actor: they differ before any sync
    with pytest.raises(WeightSyncError, match="before any update, with the same weights on both sides"):
        _calibrated(_Actor(), _Engine(gap=CALIBRATION_CEILING["bfloat16"] * 2))
    with pytest.raises(WeightSyncError, match="configured actor_rollout_ref.rollout.weight_sync_check_tolerance"):
        _calibrated(_Actor(), _Engine(), configured=GAP / 2)
    assert _calibrated(_Actor(), _Engine(), configured=0.3).tolerance == 0.3  # configured replaces calibrated


def test_a_correct_sync_passes_while_the_rounding_gap_wanders_within_the_margin():
    actor, engine = _Actor(), _Engine()
    check = _calibrated(actor, engine)
    for step, gap in enumerate((GAP, 1.5 * GAP, 2.5 * GAP, 0.5 * GAP), start=1):
        actor.shift = 0.02 * step  # every update moves the probe by less than the tolerance (0.04)
        engine.gap = gap
        engine.load(actor.shift)
        metrics = check.run(engine, actor, "the adapter weights")
        assert metrics["rollout/sync_check/mean_abs_diff"] == pytest.approx(gap, rel=0.15)
        assert metrics["rollout/sync_check/tolerance"] == check.tolerance
        assert metrics["rollout/sync_check/adapter_effect"] == pytest.approx(0.02 * step)
    engine.gap = 6 * GAP  # beyond the margin: the engine no longer serves these weights faithfully
    actor.shift += 0.02
    engine.load(actor.shift)
    with pytest.raises(WeightSyncError, match="tolerance"):
        check.run(engine, actor, "the adapter weights")


# ----------------------------------------------------------------------------- verdicts
def test_a_missing_adapter_is_caught_at_the_first_update_although_it_moved_the_probe_less_than_the_tolerance():
    """Step 0: B = 0, the adapter is the base model, nothing to tell. After the first update the adapter
    moves the probe by 0.03, below the tolerance (0.04 = 4 x the 0.01 gap; a fixed bf16 tolerance of 5e-2
    passed this), but by 3x the gap: an engine still serving the base lies within half of it of the base."""
    actor, engine = _Actor(), _Engine()
    check = _calibrated(actor, engine)
    engine.load(0.0)  # the first rollout: the (zero) adapter is installed
    check.run(engine, actor, "the adapter weights")
    actor.shift = 0.03  # the first update; the adapter never reaches the engine
    engine.load(0.0)
    with pytest.raises(WeightSyncError) as err:
        check.run(engine, actor, "the adapter weights")
    assert "lie nearer the base model's" in str(err.value)
    assert "the rollout is sampling from the base model, the trained adapter did not reach it" in str(err.value)


def test_the_same_first_update_synced_correctly_passes():
    actor, engine = _Actor(), _Engine()
    check = _calibrated(actor, engine)
    actor.shift = 0.03
    engine.load(0.03)
    metrics = check.run(engine, actor, "the adapter weights")
    assert metrics["rollout/sync_check/mean_abs_diff"] < metrics["rollout/sync_check/served_vs_base"]


def test_an_update_within_the_rounding_gap_cannot_be_told_and_is_not_failed():
    actor, engine = _Actor(), _Engine()
    check = _calibrated(actor, engine)
    actor.shift = 0.5 * GAP  # rounding blurs it: neither verdict would mean anything
    engine.load(0.0)
    check.run(engine, actor, "the adapter weights")


def test_full_weights_that_stay_at_the_previous_sync_are_named_as_such():
    actor, engine = _Actor(lora=False), _Engine()
    check = _calibrated(actor, engine)
    actor.shift = 0.1  # update 1, synced
    engine.load(0.1)
    metrics = check.run(engine, actor, "the full weights")
    assert metrics["rollout/sync_check/update_effect"] == pytest.approx(0.1)
    actor.shift = 0.13  # update 2, lost: the engine serves update 1's weights (0.03 away, below the tolerance)
    engine.load(0.1)
    with pytest.raises(WeightSyncError, match="nearer the previous model's .*this update did not reach it"):
        check.run(engine, actor, "the full weights")


def test_weights_that_are_neither_are_stale_or_partial_and_a_nan_never_passes():
    trained, base = BASE + 0.2 * DIRECTION, BASE
    served = trained + 0.3 * torch.sign(torch.cos(torch.arange(N) * 1.7))  # far from both, nearer neither
    message = diagnose(compare(served, trained, {"base": base, "previous": base}, 0.04), "the adapter weights")
    assert "match neither the trained actor nor the base model (0.3" in message
    full = diagnose(compare(served, trained, {}, 0.04), "the full weights")
    assert "weights other than the trained ones (stale or partial update)" in full
    nan = compare(torch.full((N,), float("nan")), BASE, {}, 1e-3)
    assert diagnose(nan, "x") is not None
    assert diagnose(compare(BASE, BASE, {"base": BASE}, 1e-3), "x") is None


@pytest.mark.parametrize("heavy_tails", [False, True])
def test_the_nearer_rule_never_fails_a_faithful_engine_and_catches_a_missed_update_beyond_3x_the_noise(heavy_tails):
    """Random effects and rounding noise (independent per token; Gaussian or Student-t with 3 degrees of
    freedom) on a 96-token probe: whatever the ratio of the update to the noise, an engine serving the
    trained weights is never failed; one that missed the update is caught once the update is 3x the noise."""
    import numpy as np

    rng = np.random.default_rng(7)
    for ratio in (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0):
        caught = 0
        for _ in range(200):
            trained = torch.zeros(96)
            previous = torch.as_tensor(rng.standard_normal(96) * ratio, dtype=torch.float32)
            noise = rng.standard_t(3, 96) if heavy_tails else rng.standard_normal(96)
            noise = torch.as_tensor(noise, dtype=torch.float32)
            faithful = compare(trained + noise, trained, {"previous": previous}, tolerance=1e9)
            assert diagnose(faithful, "x") is None, ratio
            missed = compare(previous + noise, trained, {"previous": previous}, tolerance=1e9)
            caught += diagnose(missed, "x") is not None
        if ratio >= 3.0 and not heavy_tails:
            assert caught == 200, ratio
        if ratio >= 4.0:
            assert caught >= 190, ratio
