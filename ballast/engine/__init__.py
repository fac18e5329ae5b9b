"""Training engine: one HF model on a (dp, sp) mesh with FSDP2 (or DDP for whole replicas), driven by
TensorDict mini-batches.

No Ray and no `ballast.protocol` here: the engine runs under plain `torchrun` (gloo on CPU, NCCL on
GPU). See docs/engine.md for the data flow, the loss formulas and the gradient-invariance argument.
The plans it executes (`PhasePlan`, `MiniBatchPlan`) come from `ballast.balance.plan_phase` and are
re-exported here for the workers, which hand them to the engine. `build_engine` is the one place that
decides which engine a config gets: `PipelineEngine` (`ballast.engine.pipeline`) with pipeline
parallelism, `TrainEngine` otherwise.
"""

from ballast.balance import MiniBatchPlan, PhasePlan
from ballast.engine.config import EngineConfig, MicroBatchSpec, OptimConfig
from ballast.engine.engine import TrainEngine
from ballast.engine.losses import LOSS_AGG_MODES, GlobalNorm, agg_loss
from ballast.engine.pipeline import PipelineEngine


def build_engine(cfg: EngineConfig, seed: int = 0):
    """The engine for `cfg` over the default process group: a `PipelineEngine` when
    `cfg.pipeline.pp_size > 1`, else a `TrainEngine`. Both keep the same contract (docs/engine.md)."""
    if cfg.pipeline.enabled:
        return PipelineEngine(cfg, seed=seed)
    return TrainEngine(cfg, seed=seed)


__all__ = [
    "LOSS_AGG_MODES",
    "EngineConfig",
    "GlobalNorm",
    "MicroBatchSpec",
    "MiniBatchPlan",
    "OptimConfig",
    "PhasePlan",
    "PipelineEngine",
    "TrainEngine",
    "agg_loss",
    "build_engine",
]
