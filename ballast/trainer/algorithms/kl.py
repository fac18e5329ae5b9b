"""KL estimators between the policy and the reference, and the in-reward KL coefficient controllers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Literal, get_args

import torch

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KLControllerType = Literal["fixed", "adaptive"]
KL_CONTROLLERS: tuple[str, ...] = get_args(KLControllerType)


def _k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


def _abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


def _k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


def _k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    # Unbiased, non-negative estimator exp(r) - r - 1 with r = ref - logp; clamped because one
    # far-off token would otherwise dominate the loss (the estimator is exponential in r).
    log_ratio = torch.clamp(ref_log_prob - log_prob, -20.0, 20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


def _straight_through(forward: KLFn) -> KLFn:
    """The value of `forward` with the gradient of k2 (whose gradient is the unbiased KL gradient;
    k1's and k3's are not): verl's '+' suffix, e.g. k3+."""
    def kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
        k2 = _k2(log_prob, ref_log_prob)
        return k2 - k2.detach() + forward(log_prob, ref_log_prob).detach()

    return kl


KL_PENALTIES: Dict[str, KLFn] = {"kl": _k1, "k1": _k1, "abs": _abs, "mse": _k2, "k2": _k2, "low_var_kl": _k3, "k3": _k3}
KL_PENALTIES.update({f"{name}+": _straight_through(fn) for name, fn in list(KL_PENALTIES.items()) if fn is not _k2})
KL_PENALTIES.update({"mse+": _k2, "k2+": _k2})  # k2 already has the right gradient


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    if kind not in KL_PENALTIES:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {sorted(KL_PENALTIES)}")
    return KL_PENALTIES[kind](log_prob, ref_log_prob)


@dataclass
class FixedKLController:
    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps


@dataclass
class AdaptiveKLController:
    """Proportional controller steering the observed KL toward `target_kl` (Ziegler et al. 2019)."""

    value: float
    target_kl: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(kind: str, kl_coef: float, target_kl: float, horizon: int):
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl: adaptive needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"algorithm.kl_ctrl.type={kind!r} is not one of {', '.join(map(repr, KL_CONTROLLERS))}")
