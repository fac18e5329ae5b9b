"""After a weight sync, check that the rollout engine really serves the weights the actor trained.

The failure this exists for is silent: the rollout keeps sampling from the base model (or the weights
of an earlier step) because an update never reached the inference engine, while every training metric
still looks plausible. So after each sync every worker scores one fixed probe sequence, teacher-forced
log-probs at temperature 1, under

* `served`: the rollout engine (with its current adapter, if it serves one);
* `trained`: the actor engine (with its adapter);
* the alternatives the engine could be serving instead: `base`, the actor with its adapter switched
  off (LoRA runs: the base is frozen, so it is scored once), and `previous`, the trained log-probs of
  the last passed check (what a sync that never arrived leaves the engine serving).

Verdict. The check fails when mean |served - trained| exceeds the tolerance, or when `served` lies
within half the distance between `trained` and an alternative of that alternative (distances: mean
absolute differences, a metric): then it is nearer the alternative than the trained model by the
triangle inequality, and a faithful engine could only sit there if its rounding exceeded half of what
the update moved. The second rule is what makes the check bite from the first update on: one small step
(LoRA's B starts at 0) moves the probe by much less than a fixed half-precision tolerance, yet an engine
that missed it sits right at the alternative. It needs no noise model and no threshold: on simulated
rounding noise (Gaussian and heavy-tailed, 96 tokens) it never failed a faithful engine, and caught a
missed sync once the update moved the probe by about 2-3x the rounding gap (the tolerance alone: 4x).

Tolerance. Calibrated at the first check, taken where both sides hold the same weights by
construction: colocated, at start-up, the engine just built from the model directory against the
actor (adapter switched off); a rollout pool of its own, before its first weight load, the engine
against the trainer's start-up scores. The gap measured there is rounding alone (kernels, dtypes);
the tolerance is `TOLERANCE_MARGIN` x that gap, at least the floor of the least precise dtype
(`TOLERANCE_FLOOR`: identical kernels can measure 0, and the gap varies as the weights move). A gap
above `CALIBRATION_CEILING` at that point means the two sides do not hold the same model: the run
stops. A configured tolerance (`actor_rollout_ref.rollout.weight_sync_check_tolerance`) replaces the
calibrated one, and the start-up gap must be within it. Every verdict is agreed over the worker group
(one MAX all-reduce) so that every rank raises together instead of leaving its peers waiting in the
next collective; the calibrated gap is agreed the same way, so every rank uses one tolerance.

The probe is a fixed short conversation in the model's own chat template (`probe_tokens`), text of the
kind the engine serves, rather than random ids: those are far out of distribution, where log-probs are
large and their rounding too, and where an adapter trained on real prompts changes little. It is cut
to `PROBE_TOKENS` (and the engine's context). Cost per check: one forward of the probe in the actor and
one prompt-log-prob call in the rollout engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

PROBE_TOKENS = 96
PROBE_MESSAGES = (
    {"role": "user", "content": "A train leaves the station at 9:15 and arrives at 11:40. How long is the trip? "
                                "Explain your answer in one or two sentences."},
    {"role": "assistant", "content": "The trip takes 2 hours and 25 minutes: from 9:15 to 11:15 is two hours, and "
                                     "from 11:15 to 11:40 is another 25 minutes, so the answer is 2 h 25 min."},
)
# Tolerance = max(MARGIN x the start-up gap, FLOOR); a start-up gap above the CEILING is a different model.
# Measured on CPU (docs/rollout.md): the gap on later weights stayed within 0.9-1.2x the start-up gap,
# fp32 gaps 1e-7 to 1e-5, bf16 engines 1e-3 (tiny model) to 4e-2 (SmolLM2-135M); floors of about one
# rounding step of a typical log-prob (|log p| ~ 3) in half precision.
TOLERANCE_MARGIN = 4.0
TOLERANCE_FLOOR = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 2e-3}
CALIBRATION_CEILING = {"float32": 1e-2, "bfloat16": 0.2, "float16": 0.1}
METRIC_PREFIX = "rollout/sync_check"
# What the engine serves when it matches an alternative, for the error message.
_MEANING = {
    "base": "the rollout is sampling from the base model, the trained adapter did not reach it",
    "previous": "the rollout still serves the weights of the previous sync, this update did not reach it",
}


class WeightSyncError(RuntimeError):
    """The rollout engine does not serve the actor's weights after a sync."""


def _least_precise(table: dict, dtypes) -> float:
    return max(table.get(d, max(table.values())) for d in dtypes)


def calibrated_tolerance(gap: float, *dtypes: str) -> float:
    """The tolerance a start-up gap calls for: `TOLERANCE_MARGIN` x `gap`, at least the floor of the least
    precise of `dtypes` (the rollout engine's and the trainer's compute dtype names)."""
    return max(TOLERANCE_MARGIN * gap, _least_precise(TOLERANCE_FLOOR, dtypes))


def calibration_error(gap: float, configured: Optional[float], *dtypes: str) -> Optional[str]:
    """None when a start-up gap is what rounding explains (or what the configured tolerance accepts),
    else the error message."""
    limit = configured if configured is not None else _least_precise(CALIBRATION_CEILING, dtypes)
    if gap <= limit:  # a NaN fails
        return None
    accepts = (f"the configured actor_rollout_ref.rollout.weight_sync_check_tolerance={configured:g}"
               if configured is not None else
               f"{limit:g}, the most rounding explains in {'/'.join(sorted(set(dtypes)))}")
    return (f"weight sync check: before any update, with the same weights on both sides, the rollout engine's "
            f"log-probs on the probe differ from the actor's by {gap:.3g} on average, more than {accepts}: the "
            "engine does not serve the model the actor loaded (another checkpoint, tokenizer or dtype?). Set "
            "actor_rollout_ref.rollout.weight_sync_check_tolerance to accept it, or weight_sync_check=False")


def probe_tokens(tokenizer, vocab_size: int, max_tokens: int = PROBE_TOKENS) -> tuple[int, ...]:
    """`PROBE_MESSAGES` in the tokenizer's chat template, as ids, cut to `max_tokens`: the same on every
    rank. Raises ValueError when an id is outside [0, vocab_size) or fewer than 2 tokens remain."""
    text = tokenizer.apply_chat_template(list(PROBE_MESSAGES), tokenize=False)
    ids = tuple(int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens])
    if len(ids) < 2:
        raise ValueError(f"the weight-sync probe has {len(ids)} token(s) (max_tokens={max_tokens}); it needs 2")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"the weight-sync probe holds token id {bad[0]}, outside the model's vocabulary "
                         f"[0, {vocab_size}): the tokenizer does not belong to the model")
    return ids


def start_log_probs(engine, tokens) -> torch.Tensor:
    """The actor `engine`'s log-probs on `tokens` under the model directory's weights, as a rollout engine
    just built from that directory serves them: with the adapter switched off (LoRA), at start-up."""
    if engine.adapter is None:
        return engine.probe_log_probs(list(tokens)).float()
    with engine.adapter_disabled():
        return engine.probe_log_probs(list(tokens)).float()


def _mean_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().mean())


@dataclass(frozen=True)
class CheckResult:
    """Mean absolute log-prob differences on the probe: served vs trained (`error`, and its max), served
    vs each alternative (`to`), trained vs each alternative (`effect`: how far the update or the adapter
    moved the model from it)."""

    error: float
    max_error: float
    tolerance: float
    to: dict = field(default_factory=dict)
    effect: dict = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        out = {f"{METRIC_PREFIX}/mean_abs_diff": self.error, f"{METRIC_PREFIX}/max_abs_diff": self.max_error,
               f"{METRIC_PREFIX}/tolerance": self.tolerance}
        names = {"base": "adapter_effect", "previous": "update_effect"}
        for name in self.to:
            out[f"{METRIC_PREFIX}/served_vs_{name}"] = self.to[name]
            out[f"{METRIC_PREFIX}/{names.get(name, name + '_effect')}"] = self.effect[name]
        return out


def compare(served: torch.Tensor, trained: torch.Tensor, alternatives: dict, tolerance: float) -> CheckResult:
    """`alternatives`: name -> log-probs of what the engine might serve instead (e.g. "base", "previous")."""
    diff = (served.float() - trained.float()).abs()
    return CheckResult(float(diff.mean()), float(diff.max()), float(tolerance),
                       {n: _mean_abs(served, a) for n, a in alternatives.items()},
                       {n: _mean_abs(trained, a) for n, a in alternatives.items()})


def served_alternative(result: CheckResult, name: str) -> bool:
    """Whether the engine decisively serves alternative `name`: it lies within half the distance between
    the trained model and `name` of `name` (so nearer `name` than the trained model)."""
    return result.to[name] < result.effect[name] / 2


def diagnose(result: CheckResult, what: str) -> Optional[str]:
    """None when `result` passes, else the error message naming the likely cause."""
    nearer = [n for n in result.to if served_alternative(result, n)]
    if result.error <= result.tolerance and not nearer:  # a NaN fails
        return None
    text = (f"weight sync check failed: after syncing {what}, the rollout engine's log-probs on a fixed probe "
            f"differ from the trained actor's by {result.error:.3g} on average (max {result.max_error:.3g}; "
            f"tolerance {result.tolerance:.3g}, calibrated at start-up unless "
            "actor_rollout_ref.rollout.weight_sync_check_tolerance sets it)")
    if nearer:
        name = min(nearer, key=lambda n: result.to[n])
        return text + (f", and lie nearer the {name} model's ({result.to[name]:.3g}), which the actor has moved "
                       f"away from by {result.effect[name]:.3g}: {_MEANING.get(name, name)}.")
    if result.to:
        return text + ": they match neither the trained actor nor " + " nor ".join(
            f"the {n} model ({result.to[n]:.3g})" for n in result.to) + ": stale or partially updated weights."
    return text + ": the rollout is sampling from weights other than the trained ones (stale or partial update)."


def agree(message: Optional[str], group=None) -> None:
    """Agree a verdict over `group` (default: the world; one MAX all-reduce) and raise `WeightSyncError`
    on every rank when any rank failed."""
    failed = torch.tensor([0.0 if message is None else 1.0])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if failed.item():
        raise WeightSyncError(message or "weight sync check failed on another worker (see that worker's error)")


def _agreed_max(value: float) -> float:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value if math.isfinite(value) else math.inf], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class SyncCheck:
    """One worker's check: its probe, its tolerance (calibrated once), the log-probs of the alternatives.

    `configured`: a tolerance that replaces the calibrated one; `dtypes`: the rollout engine's and the
    trainer's compute dtype names. Every method is collective over the default process group (and the
    actor's mesh / the rollout TP group where it scores the probe): call it on every rank alike."""

    def __init__(self, tokens: tuple[int, ...], configured: Optional[float], *dtypes: str) -> None:
        self.tokens, self.configured, self.dtypes = tuple(tokens), configured, dtypes
        self.tolerance: Optional[float] = None
        self.start_gap: Optional[float] = None
        self._base: Optional[torch.Tensor] = None      # LoRA: the actor with its adapter off
        self._previous: Optional[torch.Tensor] = None  # the trained log-probs the engine served last

    def calibrate(self, served: torch.Tensor, same: torch.Tensor) -> dict[str, float]:
        """The first check: `served` (the engine) and `same` (the trainer's log-probs of the very weights
        the engine holds) differ by rounding alone. Sets the tolerance, or raises on every rank."""
        gap = _agreed_max(_mean_abs(served, same))
        agree(calibration_error(gap, self.configured, *self.dtypes))
        self.start_gap = gap
        self.tolerance = self.configured if self.configured is not None else calibrated_tolerance(gap, *self.dtypes)
        self._previous = same.float().clone()
        return {f"{METRIC_PREFIX}/start_gap": gap, f"{METRIC_PREFIX}/tolerance": self.tolerance}

    def calibrate_colocated(self, backend, engine) -> dict[str, float]:
        """At start-up, before any sync: the engine holds the model directory's weights, and so does the
        actor with its adapter switched off (or without one); under LoRA that is also the frozen base."""
        same = start_log_probs(engine, self.tokens)
        if engine.adapter is not None:
            self._base = same
        return self.calibrate(backend.prompt_log_probs([list(self.tokens)])[0], same)

    def verdict(self, served: torch.Tensor, trained: torch.Tensor, what: str) -> dict[str, float]:
        """Check `served` against `trained` and the alternatives, agree the verdict; this rank's metrics."""
        if self.tolerance is None:
            raise RuntimeError("SyncCheck.verdict before calibrate")
        alternatives = {name: t for name, t in (("base", self._base), ("previous", self._previous)) if t is not None}
        result = compare(served, trained, alternatives, self.tolerance)
        agree(diagnose(result, what))
        self._previous = trained.float().clone()
        return {**result.metrics(), f"{METRIC_PREFIX}/start_gap": self.start_gap}

    def run(self, backend, engine, what: str) -> dict[str, float]:
        """Colocated, after a sync: score the probe on the actor `engine` and the rollout `backend`."""
        trained = engine.probe_log_probs(list(self.tokens))
        return self.verdict(backend.prompt_log_probs([list(self.tokens)])[0], trained, what)
