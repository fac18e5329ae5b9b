"""Pipeline parallelism: one model cut into stages over a (dp, pp) mesh, run by
torch.distributed.pipelining's schedules behind the engine contract (`PipelineEngine`).

Modules: `layout` (the mesh and its groups), `stages` (the model cut into stage modules),
`slots` (fixed-shape micro-batches and the shape guard), `runner` (the torch schedules, timed),
`weights` (gradient sums, the clipped step, full weights), `store` (checkpoint layout, HF export),
`engine` (`PipelineEngine`). The plans it runs come from `ballast.balance` (a policy carrying a
`PipelineCostModel`); docs/pipeline.md.
"""

from ballast.engine.pipeline.engine import PipelineEngine
from ballast.engine.pipeline.layout import PipelineParallelState, build_pipeline_state

__all__ = ["PipelineEngine", "PipelineParallelState", "build_pipeline_state"]
