"""The driver's step planner: each phase's plan from the config, reproducible per step and role,
shared between identical inference passes, and the forward-only plan over the rows after the actor's
first mini-batch."""

import numpy as np
import torch

from ballast.protocol import Batch
from ballast.trainer.config import derive_sizes, load_config
from ballast.trainer.step.plans import StepPlanner, epoch_partitions, row_lengths

BASE = ["data.train_files=/data/train.parquet", "actor_rollout_ref.model.path=/models/tiny",
        "trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=96", "actor_rollout_ref.actor.shuffle=true",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=64",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=64",
        "actor_rollout_ref.actor.use_kl_loss=true", "data.max_prompt_length=16", "data.max_response_length=32"]


def _batch(n=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompt, response = 16, 32
    lengths = torch.randint(1, response + 1, (n,), generator=gen)
    mask = torch.zeros(n, prompt + response, dtype=torch.int64)
    mask[:, prompt - 4:prompt] = 1
    for i, length in enumerate(lengths.tolist()):
        mask[i, prompt:prompt + length] = 1
    ids = torch.randint(3, 50, (n, prompt + response), generator=gen) * mask
    return Batch({"input_ids": ids, "attention_mask": mask, "responses": ids[:, prompt:]},
                 non_tensors={"uid": np.repeat(np.arange(n // 4), 4).astype(str)})


def _planner(batch, step=0, *overrides):
    cfg = load_config(BASE + list(overrides))
    return StepPlanner(cfg, derive_sizes(cfg), "tokens", batch, step)


def test_update_plan_follows_the_config_and_reproduces_per_step():
    batch = _batch()
    plan = _planner(batch).update("actor")
    assert plan.dp_size == 2 and plan.epochs == 1 and len(plan.mini_batches) == 4  # 32 rows / (2 prompts x 4)
    lengths = row_lengths(batch)
    for m, mini in enumerate(plan.mini_batches):
        for r in range(2):
            assert all(lengths[plan.partitions(m)[r][mb]].sum() <= 96 for mb in mini.for_rank(r))
    assert np.array_equal(_planner(batch).update("actor").rows, plan.rows)
    assert not np.array_equal(_planner(batch, 1).update("actor").rows, plan.rows)  # reshuffled next step
    assert sorted(np.concatenate(epoch_partitions(plan)).tolist()) == list(range(32))


def test_identical_inference_passes_share_one_plan():
    planner = _planner(_batch())
    assert planner.inference("actor") is planner.inference("ref")  # same dp and budget
    other = _planner(_batch(), 0, "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=128")
    assert other.inference("actor") is not other.inference("ref")


def test_rows_after_the_first_mini_batch_are_planned_where_they_are():
    batch = _batch()
    planner = _planner(batch)
    plan = planner.update("actor")
    rest = planner.after_first_mini_batch(plan)
    lengths = row_lengths(batch)
    assert len({len(rank) for rank in rest.micro_batches}) == 1
    for r in range(2):
        rows = plan.rank_rows(r)[plan.mini_batches[0].rows_per_rank[r]:]
        assert rest.rows_per_rank[r] == len(rows)
        assert sorted(np.concatenate(rest.for_rank(r)).tolist()) == list(range(len(rows)))
        assert all(lengths[rows[mb]].sum() <= 64 for mb in rest.for_rank(r))
    single = _planner(batch, 0, "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    assert single.after_first_mini_batch(single.update("actor")) is None


def test_each_phase_plans_for_how_its_engine_synchronises():
    from ballast.balance import PlanObjective
    from ballast.engine import EngineConfig
    from ballast.trainer.step.plans import phase_objectives

    replicas = EngineConfig(model_path="/m", fsdp_size=1)  # whole replicas: DDP, one all-reduce per mini-batch
    sharded = EngineConfig(model_path="/m")  # FSDP2 re-gathers the parameters every micro-batch
    kept = EngineConfig(model_path="/m", reshard_after_forward=False)  # gathered once, reduced once on CPU
    frozen = EngineConfig(model_path="/m", role="ref", fsdp_size=1)
    got = phase_objectives({"actor": replicas, "critic": sharded, "ref": frozen}, 2, "cpu")
    assert got[("actor", True)] is got[("actor", False)] is PlanObjective.RANK_TOTAL
    assert got[("critic", True)] is got[("critic", False)] is PlanObjective.LOCKSTEP
    assert got[("ref", False)] is PlanObjective.RANK_TOTAL
    kept_cpu, kept_gpu = phase_objectives({"actor": kept}, 2, "cpu"), phase_objectives({"actor": kept}, 2, "cuda")
    assert kept_cpu[("actor", True)] is PlanObjective.RANK_TOTAL
    assert kept_gpu[("actor", True)] is PlanObjective.LOCKSTEP  # GPU reduce-scatters after every backward
    assert kept_gpu[("actor", False)] is PlanObjective.RANK_TOTAL


def test_the_planner_passes_each_phases_objective():
    from ballast.balance import PlanObjective

    batch = _batch(n=64, seed=4)
    cfg = load_config(BASE + ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                              "trainer.n_gpus_per_node=4"])
    by = {}
    for objective in PlanObjective:
        planner = StepPlanner(cfg, derive_sizes(cfg), "tokens", batch, 0, {("actor", True): objective})
        plan = planner.update("actor")
        assert plan.objective is objective
        by[objective] = plan.metrics
    # each plan is at least as good as the other on its own objective
    assert by[PlanObjective.RANK_TOTAL]["plan/max_rank_total_over_bound"] <= \
        by[PlanObjective.LOCKSTEP]["plan/max_rank_total_over_bound"]
    assert by[PlanObjective.LOCKSTEP]["plan/lockstep_over_lower_bound"] <= \
        by[PlanObjective.RANK_TOTAL]["plan/lockstep_over_lower_bound"]


SHARED = ["actor_rollout_ref.actor.use_prefix_grouper=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=160",
          "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=160",
          "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=160"]


def _grouped_batch(n=32, seed=0):
    """`_batch` with the 4 rows of every uid holding one prompt, and position ids."""
    batch = _batch(n, seed)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ids[:, :16] = ids[::4, :16].repeat_interleave(4, dim=0)
    batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return batch


def test_shared_prompts_plan_the_actor_and_reference_phases_over_whole_prompts():
    from ballast.trainer.step.plans import prompt_ids

    batch = _grouped_batch()
    ids = prompt_ids(batch)
    assert len(np.unique(ids)) == 8 and all(len(set(ids[i:i + 4])) == 1 for i in range(0, 32, 4))
    planner = _planner(batch, 0, *SHARED)
    update, infer = planner.update("actor"), planner.inference("actor")
    assert all(m.shared_prompts for m in update.mini_batches + infer.mini_batches)
    assert planner.inference("ref") is infer
    rest = planner.after_first_mini_batch(update)
    assert rest.shared_prompts
    for r in range(2):
        rows = update.rank_rows(r)[update.mini_batches[0].rows_per_rank[r]:]
        for mb in rest.for_rank(r):
            assert len(rows[mb]) % 4 == 0 and len(np.unique(ids[rows[mb]])) == len(rows[mb]) // 4
    plain = _planner(batch, 0, *SHARED[1:])
    assert not any(m.shared_prompts for m in plain.update("actor").mini_batches)
