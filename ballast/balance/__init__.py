"""Pure batch math for balancing RL training steps (numpy only, no torch required, no processes).

* workload models: :func:`workload_costs` with ``"tokens"``, ``"verl"`` or a :class:`FlopsModel`;
* partitioning: :func:`karmarkar_karp`, :func:`greedy_partition`, :func:`refine_partition`,
  :func:`validate_partition`;
* DP balance: :func:`balance_batch` -> :class:`BalancePlan` (order, partitions, verl-named metrics);
* micro-batches: :func:`plan_static_micro_batches`, :func:`min_micro_batches`,
  :func:`plan_dynamic_micro_batches`, :func:`plan_joint_micro_batches`, :func:`inverse_permutation`;
* length bucketing: :func:`bucket_ids`, :func:`min_bucketed_micro_batches`,
  :func:`plan_bucketed_micro_batches` (micro-batches that never mix prompt-length buckets);
* the lockstep cost model of FSDP micro-steps: :func:`lockstep_cost`, :func:`refine_lockstep`
  (exchanges inside each rank), :func:`refine_lockstep_across_ranks` (swaps between ranks too);
* the whole-step plan the trainer runs: :func:`plan_step` -> :class:`StepPlan` (DP partition and
  micro-batches chosen together for a :class:`PlanObjective`: ``"lockstep"`` for engines with
  collectives in every micro-batch, ``"rank_total"`` for one gradient sync per mini-batch),
  :func:`lockstep_lower_bounds`.
"""

from .bucketing import bucket_ids, min_bucketed_micro_batches, plan_bucketed_micro_batches
from .dp_balance import BalancePlan, balance_batch, balance_metrics
from .joint import lockstep_cost, plan_joint_micro_batches, refine_lockstep, refine_lockstep_across_ranks
from .micro_batch import (
    inverse_permutation,
    min_micro_batches,
    plan_dynamic_micro_batches,
    plan_static_micro_batches,
)
from .partition import greedy_partition, karmarkar_karp, partition_sums, validate_partition
from .refine import refine_partition
from .step_plan import PlanObjective, StepPlan, lockstep_lower_bounds, plan_step
from .workload import VERL_LINEAR_COEFF, FlopsModel, Workload, workload_costs

__all__ = [
    "BalancePlan",
    "FlopsModel",
    "PlanObjective",
    "VERL_LINEAR_COEFF",
    "StepPlan",
    "Workload",
    "balance_batch",
    "bucket_ids",
    "min_bucketed_micro_batches",
    "plan_bucketed_micro_batches",
    "balance_metrics",
    "greedy_partition",
    "inverse_permutation",
    "karmarkar_karp",
    "lockstep_cost",
    "lockstep_lower_bounds",
    "min_micro_batches",
    "partition_sums",
    "plan_dynamic_micro_batches",
    "plan_joint_micro_batches",
    "plan_static_micro_batches",
    "plan_step",
    "refine_lockstep",
    "refine_lockstep_across_ranks",
    "refine_partition",
    "validate_partition",
    "workload_costs",
]
