"""The FSDP settings each role runs with, and the start-up rules on them.

One section type (`schema.FSDPConfig`) sits in four places. The actor's and the critic's sections are
complete; in the other two a null field is inherited: `actor_rollout_ref.ref.fsdp_config` from the
actor's (the reference model shares the actor's device mesh, as in verl), `critic.model.fsdp_config`
(verl's older spelling) from `critic.fsdp_config`, which a field set there overrides.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from ballast.trainer.config.loader import ConfigError
from ballast.trainer.config.schema import BallastConfig, FSDPConfig, MixedPrecisionSection

ACTOR = "actor_rollout_ref.actor.fsdp_config"
REF = "actor_rollout_ref.ref.fsdp_config"
CRITIC = "critic.fsdp_config"
CRITIC_MODEL = "critic.model.fsdp_config"
# Placement -> the placement its null fields come from.
INHERITS = {REF: ACTOR, CRITIC_MODEL: CRITIC}


def placements(cfg: BallastConfig) -> List[Tuple[str, FSDPConfig]]:
    """(key prefix, section) of every FSDP section in the config, as written."""
    arr = cfg.actor_rollout_ref
    return [(ACTOR, arr.actor.fsdp_config), (REF, arr.ref.fsdp_config), (CRITIC, cfg.critic.fsdp_config),
            (CRITIC_MODEL, cfg.critic.model.fsdp_config)]


def role_fsdp(cfg: BallastConfig, role: str) -> FSDPConfig:
    """The settings `role` (`actor`, `ref` or `critic`) runs with, every field set (but `mixed_precision`'s,
    where null is the device's default)."""
    arr = cfg.actor_rollout_ref
    if role == "actor":
        return arr.actor.fsdp_config
    if role == "ref":
        return _over(arr.ref.fsdp_config, arr.actor.fsdp_config)
    return _over(cfg.critic.model.fsdp_config, cfg.critic.fsdp_config)


def _over(top, base):
    """`top` with its null fields taken from `base` (field by field, also inside a section both have)."""
    def pick(name):
        mine, theirs = getattr(top, name), getattr(base, name)
        if mine is None:
            return theirs
        return _over(mine, theirs) if dataclasses.is_dataclass(mine) and theirs is not None else mine
    return type(top)(**{f.name: pick(f.name) for f in dataclasses.fields(top)})


# verl's dtype spellings (`PrecisionType`) -> the engine's precision names. fp16 is not offered: it needs
# loss scaling, which the engine does not do.
DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32", "32": "fp32"}
HALF = ("fp16", "float16", "16")


def role_precision(cfg: BallastConfig, role: str) -> str:
    """The engine precision `role` runs with: `auto` (the device's default), `bf16` or `fp32`."""
    section = role_fsdp(cfg, role).mixed_precision
    if section is None or section.param_dtype is None:
        return "auto"
    return DTYPE_NAMES[str(section.param_dtype).lower()]


def precision_notes(precisions: Dict[str, str], device: str, native_bf16: bool) -> List[str]:
    """Start-up lines about the engines' compute precisions (role -> `EngineConfig.precision`) when any is
    set explicitly, and a warning when bf16 compute runs on a CPU without bf16 instructions."""
    if all(p == "auto" for p in precisions.values()):
        return []
    lines = ["compute precision: " + ", ".join(f"{role} {p}" for role, p in precisions.items())
             + " (auto: bf16 on CUDA, fp32 on CPU; master weights, gradients and optimizer states stay fp32)"]
    if device == "cpu" and "bf16" in precisions.values() and not native_bf16:
        lines.append("warning: bf16 compute on a CPU without bf16 instructions (avx512_bf16, amx_bf16): its "
                     "matmuls are emulated and slower than fp32; unset fsdp_config.mixed_precision.param_dtype")
    return lines


def _check_precision(prefix: str, section: Optional[MixedPrecisionSection]) -> None:
    if section is None:
        return
    for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        value = getattr(section, name)
        if value is None:
            continue
        spelled = str(value).lower()
        dtype = DTYPE_NAMES.get(spelled)
        key = f"{prefix}.mixed_precision.{name}={value!r}"
        if spelled in HALF:
            raise ConfigError(f"{key}: fp16 training needs loss scaling, which Ballast does not do; use bf16")
        if dtype is None:
            raise ConfigError(f"{key} is not a dtype Ballast trains in: bf16 or fp32")
        if name != "param_dtype" and dtype != "fp32":
            raise ConfigError(f"{key}: {'gradients are reduced' if name == 'reduce_dtype' else 'buffers are kept'} "
                              "in fp32 only (set it to fp32 or null)")


def check_fsdp(cfg: BallastConfig) -> None:
    """verl's FSDP switches: each means what verl means, or the run stops here naming the key."""
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    for prefix, fsdp in placements(cfg):
        _check_precision(prefix, fsdp.mixed_precision)
        # mixed_precision null is verl's "the default" everywhere, not an unset field.
        unset = [f.name for f in dataclasses.fields(fsdp)
                 if getattr(fsdp, f.name) is None and f.name != "mixed_precision"]
        if unset and prefix not in INHERITS:
            raise ConfigError(f"{prefix}.{unset[0]}=null: set a value (only {REF} and {CRITIC_MODEL} inherit "
                              "unset fields)")
        on = [k for k in ("param_offload", "optimizer_offload", "offload_policy") if getattr(fsdp, k)]
        if on and cfg.trainer.device == "cpu":
            raise ConfigError(
                f"{prefix}.{on[0]}=True offloads from GPU to host memory, but trainer.device=cpu keeps everything "
                f"in host memory already: set {prefix}.{on[0]}=False"
            )
        if fsdp.fsdp_size is not None:
            _check_fsdp_size(f"{prefix}.fsdp_size", fsdp.fsdp_size, world)
        # The reference model has no optimizer: its param_offload is FSDP2 CPU offload, as verl means it.
        for key in ("optimizer_offload",) if prefix == REF else ("param_offload", "optimizer_offload"):
            if getattr(fsdp, key):
                raise ConfigError(
                    f"{prefix}.{key}=True (verl: move the {'parameters' if key == 'param_offload' else 'optimizer states'} "
                    f"to host memory between phases) is not implemented; {prefix}.offload_policy=True keeps "
                    "parameters, gradients and optimizer states in host memory (FSDP2 CPU offload)"
                )
    ref_size, actor_size = cfg.actor_rollout_ref.ref.fsdp_config.fsdp_size, role_fsdp(cfg, "actor").fsdp_size
    if ref_size is not None and ref_size != actor_size:
        raise ConfigError(f"{REF}.fsdp_size={ref_size} differs from {ACTOR}.fsdp_size={actor_size}: the reference "
                          f"model shares the actor's device mesh (leave {REF}.fsdp_size null)")


def _check_fsdp_size(key: str, size, world: int) -> None:
    """`size` is an int the engine's rule accepts for `world` workers (`ballast.engine.dist.resolve_shard_size`)."""
    from ballast.engine.dist import resolve_shard_size

    try:
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(size)
        resolve_shard_size(size, world)
    except ValueError:
        raise ConfigError(f"{key}={size!r}: must be -1 (shard over all {world} workers) or an int that divides the "
                          f"{world} workers (hybrid sharding: {world} / fsdp_size replicas)") from None
