"""Named rollout-correction presets: the settings verl 0.9.1's `RolloutCorrectionConfig` factories make.

Each preset is the seven `algorithm.rollout_correction` keys, with the factory's tunable thresholds as
keyword arguments under the factory's parameter names and defaults. On the command line the same
presets are hydra config-group options, `+algorithm/rollout_correction=<name>` (one yaml per preset
under `ballast/configs/algorithm/rollout_correction/`, written from this table and held equal to it
by a test); keys given after it override the preset's values.

Decoupled presets (three policies: rollout, old, current) correct the gap between the old policy and
the rollout with weights and/or rejection; bypass presets (two policies) use the rollout's log-probs
as the old policy and make no old-log-prob pass.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

Settings = Dict[str, object]


def _settings(rollout_is=None, rollout_is_threshold=2.0, rollout_rs=None, rollout_rs_threshold=None,
              bypass_mode=False, loss_type="ppo_clip") -> Settings:
    return dict(rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold, rollout_is_batch_normalize=False,
                rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold, bypass_mode=bypass_mode,
                loss_type=loss_type)


def decoupled_token_is(threshold: float = 2.0) -> Settings:
    """Token-level truncated IS (TIS)."""
    return _settings("token", threshold)


def decoupled_seq_is(threshold: float = 2.0) -> Settings:
    """Sequence-level truncated IS."""
    return _settings("sequence", threshold)


def decoupled_token_icepop(threshold: float = 5.0, threshold_lower: float = 0.5) -> Settings:
    """Token-level IcePop: weights outside [threshold_lower, threshold] are zeroed."""
    return _settings("token", f"{threshold_lower}_{threshold}")


def decoupled_seq_is_rs(is_threshold: float = 2.0, rs_threshold: Optional[object] = "0.5_2.0") -> Settings:
    """Sequence IS plus rejection of sequences whose summed log-ratio leaves the bounds (MIS)."""
    return _settings("sequence", is_threshold, "seq_sum_k1", rs_threshold)


def decoupled_geo_rs(rs_threshold: Optional[object] = "0.999_1.001") -> Settings:
    """Rejection on the per-token geometric mean of the ratio (Geo-RS)."""
    return _settings(None, 2.0, "seq_mean_k1", rs_threshold)


def decoupled_geo_rs_seq_tis(is_threshold: float = 2.0, rs_threshold: Optional[object] = "0.999_1.001") -> Settings:
    return _settings("sequence", is_threshold, "seq_mean_k1", rs_threshold)


def decoupled_geo_rs_token_tis(is_threshold: float = 2.0, rs_threshold: Optional[object] = "0.999_1.001") -> Settings:
    return _settings("token", is_threshold, "seq_mean_k1", rs_threshold)


def decoupled_k3_rs(rs_threshold: float = 0.01) -> Settings:
    """Rejection on the per-sequence mean of the k3 divergence."""
    return _settings(None, 2.0, "seq_mean_k3", rs_threshold)


def decoupled_k3_rs_seq_tis(is_threshold: float = 2.0, rs_threshold: float = 0.01) -> Settings:
    return _settings("sequence", is_threshold, "seq_mean_k3", rs_threshold)


def decoupled_k3_rs_token_tis(is_threshold: float = 2.0, rs_threshold: float = 0.01) -> Settings:
    return _settings("token", is_threshold, "seq_mean_k3", rs_threshold)


def bypass_ppo_clip() -> Settings:
    """PPO-clip with the rollout's log-probs as the old policy: the ratio does the correction."""
    return _settings(bypass_mode=True)


def bypass_ppo_clip_geo_rs(rs_threshold: Optional[object] = "0.999_1.001") -> Settings:
    return _settings(None, 2.0, "seq_mean_k1", rs_threshold, bypass_mode=True)


def bypass_ppo_clip_k3_rs(rs_threshold: float = 0.01) -> Settings:
    return _settings(None, 2.0, "seq_mean_k3", rs_threshold, bypass_mode=True)


def bypass_pg_is(threshold: float = 2.0) -> Settings:
    """REINFORCE with explicit sequence-level truncated IS weights against the rollout policy."""
    return _settings("sequence", threshold, bypass_mode=True, loss_type="reinforce")


def bypass_pg_token_icepop(threshold: float = 5.0, threshold_lower: float = 0.5) -> Settings:
    return _settings("token", f"{threshold_lower}_{threshold}", bypass_mode=True, loss_type="reinforce")


def bypass_pg_geo_rs(rs_threshold: Optional[object] = "0.999_1.001") -> Settings:
    return _settings(None, 2.0, "seq_mean_k1", rs_threshold, bypass_mode=True, loss_type="reinforce")


def bypass_pg_geo_rs_seq_tis(is_threshold: float = 2.0, rs_threshold: Optional[object] = "0.999_1.001") -> Settings:
    return _settings("sequence", is_threshold, "seq_mean_k1", rs_threshold, bypass_mode=True, loss_type="reinforce")


def bypass_pg_geo_rs_token_tis(is_threshold: float = 2.0, rs_threshold: Optional[object] = "0.999_1.001") -> Settings:
    return _settings("token", is_threshold, "seq_mean_k1", rs_threshold, bypass_mode=True, loss_type="reinforce")


def disabled() -> Settings:
    """No correction: the `rollout_corr/*` mismatch metrics only (when the rollout reports log-probs)."""
    return _settings()


PRESETS: Dict[str, Callable[..., Settings]] = {
    fn.__name__: fn for fn in (
        decoupled_token_is, decoupled_seq_is, decoupled_token_icepop, decoupled_seq_is_rs, decoupled_geo_rs,
        decoupled_geo_rs_seq_tis, decoupled_geo_rs_token_tis, decoupled_k3_rs, decoupled_k3_rs_seq_tis,
        decoupled_k3_rs_token_tis, bypass_ppo_clip, bypass_ppo_clip_geo_rs, bypass_ppo_clip_k3_rs, bypass_pg_is,
        bypass_pg_token_icepop, bypass_pg_geo_rs, bypass_pg_geo_rs_seq_tis, bypass_pg_geo_rs_token_tis, disabled,
    )
}


def preset(name: str, **thresholds) -> Settings:
    """The settings of preset `name` (a ValueError lists the names)."""
    if name not in PRESETS:
        raise ValueError(f"unknown rollout-correction preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name](**thresholds)
