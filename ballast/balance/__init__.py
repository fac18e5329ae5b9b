"""Pure batch math for balancing RL training steps (numpy only, no torch required, no processes).

The one planning entry point is :func:`plan_phase`: for one phase of a step (an inference pass or
an update of several epochs and mini-batches), which rows each data-parallel rank holds and the
micro-batches of every mini-batch (static, token-budget dynamic or length-bucketed), as a frozen
:class:`PhasePlan` that workers and the engine execute, chosen for a :class:`PlanObjective`:
``"lockstep"`` for engines with collectives in every micro-batch, ``"rank_total"`` for one gradient
sync per mini-batch. Beside it: the workload models
(:func:`workload_costs`, :class:`FlopsModel`), the raw-vs-balanced metrics (:func:`balance_metrics`)
and :func:`inverse_permutation` to restore an order. The building blocks (Karmarkar-Karp, the
lockstep planner ``plan_step``, packing, bucketing) live in their submodules. Pipeline parallelism:
:class:`PipelineShape` (ranks, virtual stages, schedule), the schedule simulator and stage split
(:mod:`.pipeline`), :class:`PipelineCostModel` (:mod:`.pipeline_cost`); a policy that carries a cost
model makes :func:`plan_phase` plan fixed-slot pipeline micro-batches (:mod:`.pipeline_plan`).
"""

from .dp_balance import balance_metrics
from .micro_batch import inverse_permutation
from .phase_plan import MicroBatchMode, MicroBatchPolicy, MiniBatchPlan, PhasePlan, plan_phase
from .pipeline import PipelineScheduleKind, PipelineShape
from .pipeline_cost import PipelineCostModel
from .step_plan import PlanObjective
from .workload import VERL_LINEAR_COEFF, FlopsModel, Workload, workload_costs

__all__ = [
    "FlopsModel",
    "MicroBatchMode",
    "MicroBatchPolicy",
    "MiniBatchPlan",
    "PhasePlan",
    "PipelineCostModel",
    "PipelineScheduleKind",
    "PipelineShape",
    "PlanObjective",
    "VERL_LINEAR_COEFF",
    "Workload",
    "balance_metrics",
    "inverse_permutation",
    "plan_phase",
    "workload_costs",
]
