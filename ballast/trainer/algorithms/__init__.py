"""RL algorithms as pure functions with one registry per family: advantage estimators, policy losses,
value loss and KL. The driver computes advantages; the losses are sent to the workers as callables."""

from __future__ import annotations

from typing import Dict, Tuple

from ballast.trainer.algorithms.advantages import ADV_ESTIMATORS, get_adv_estimator, masked_mean, masked_whiten
from ballast.trainer.algorithms.kl import KL_PENALTIES, kl_penalty, make_kl_controller


def registered_names() -> Dict[str, Tuple[str, ...]]:
    """The names each config key may take, read from the registries themselves."""
    from ballast.engine.losses import LOSS_AGG_MODES
    from ballast.trainer.algorithms.policy_loss import POLICY_LOSSES

    return {
        "adv_estimator": tuple(sorted(ADV_ESTIMATORS)),
        "policy_loss": tuple(sorted(POLICY_LOSSES)),
        "loss_agg_mode": tuple(LOSS_AGG_MODES),
        "kl_penalty": tuple(sorted(KL_PENALTIES)),
    }


__all__ = [
    "ADV_ESTIMATORS", "KL_PENALTIES", "get_adv_estimator", "kl_penalty", "make_kl_controller", "masked_mean",
    "masked_whiten", "registered_names",
]
