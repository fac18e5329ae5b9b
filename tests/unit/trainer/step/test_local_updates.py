"""A step's local updates (verl's `trainer.v1.separate_async.parameter_sync_step`): the shares of whole
prompt groups, the merged metrics, and the driver's calls per mode: how many update calls (learning-
rate scheduler steps) and optimizer steps a step makes, the old log-probs from the step's starting
weights, and each share's values and advantages from the critic as it stands at its turn. The workers
are stand-ins that count what they are asked to do."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ballast.protocol import Batch, Output
from ballast.trainer.algorithms import make_kl_controller
from ballast.trainer.config import derive_sizes, load_config
from ballast.trainer.config.off_policy import overlap
from ballast.trainer.ray_trainer import RayPPOTrainer
from ballast.trainer.run.builders import actor_loss_config
from ballast.trainer.step.local_updates import merge_local_metrics, share_rows
from ballast.trainer.step.monitor import BalanceMonitor
from ballast.trainer.step.old_log_probs import old_log_prob_source
from ballast.trainer.step.rollout_correction import RolloutCorrectionPhase
from ballast.workers.on_policy import OldLogProbMode
from ballast.workers.train_loop import UpdateResult


def test_shares_are_equal_runs_of_whole_groups_in_order():
    uids = np.repeat(["a", "b", "c", "d"], 3)
    shares = share_rows(uids, 2)
    assert [s.tolist() for s in shares] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert [s.tolist() for s in share_rows(uids, 1)] == [list(range(12))]
    with pytest.raises(ValueError, match="splits prompt group 'b'"):
        share_rows(np.repeat(["a", "b", "c"], 2), 2)
    with pytest.raises(ValueError, match="cannot be cut into 5 equal local updates"):
        share_rows(uids, 5)
    with pytest.raises(ValueError, match="prompt group 'a' has rows in two local updates"):
        share_rows(np.array(["a", "b", "a", "c"]), 2)


def test_merged_metrics_follow_what_each_measures():
    per = [{"actor/pg_loss": 1.0, "actor/lr": 0.1, "global_seqlen/max": 10.0, "global_seqlen/min": 4.0,
            "perf/num_micro_batches": 2.0, "actor/skipped_steps_total": 0.0, "global_seqlen/minmax_diff": 6.0},
           {"actor/pg_loss": 4.0, "actor/lr": 0.2, "global_seqlen/max": 8.0, "global_seqlen/min": 2.0,
            "perf/num_micro_batches": 3.0, "actor/skipped_steps_total": 1.0, "global_seqlen/minmax_diff": 6.0,
            "critic/vf_loss": 5.0}]
    merged = merge_local_metrics(per, samples=[1, 3])
    assert merged == {"actor/pg_loss": (1.0 + 3 * 4.0) / 4, "actor/lr": 0.2, "global_seqlen/max": 10.0,
                      "global_seqlen/min": 2.0, "perf/num_micro_batches": 5.0, "actor/skipped_steps_total": 1.0,
                      "global_seqlen/minmax_diff": 6.0, "critic/vf_loss": 5.0}
    assert merge_local_metrics(per[:1], [7]) == per[0]


class _Actor:
    """Counts update calls and optimizer steps; its log-probs say which weights computed them."""

    def __init__(self):
        self.optimizer_steps, self.calls, self.passes = 0, [], []

    def compute_log_prob(self, batch, plan):
        self.passes.append(len(batch))
        version = torch.full(batch["responses"].shape, -1.0 - self.optimizer_steps)
        return Output(Batch({"old_log_probs": version, "entropy": torch.zeros_like(version)}))

    def update_actor(self, batch, plan, mode, rest):
        assert mode is OldLogProbMode.PASS and rest is None
        self.calls.append((len(np.unique(plan.rows)), len(plan.mini_batches)))  # rows, optimizer steps
        # every row trains under old log-probs of the step's starting weights, whichever update it is in
        assert bool((batch["old_log_probs"] == -1.0).all())
        self.optimizer_steps += len(plan.mini_batches)
        return [UpdateResult({"actor/pg_loss": float(self.optimizer_steps), "actor/lr": float(len(self.calls))},
                             [[1] * len(plan.mini_batches)] * plan.dp_size)]


class _Critic:
    """Its values are the number of updates it has had."""

    def __init__(self):
        self.updates = 0

    def compute_values(self, batch, plan):
        return Batch({"values": torch.full(batch["responses"].shape, float(self.updates))})

    def update_critic(self, batch, plan):
        self.updates += 1
        return [UpdateResult({"critic/vf_loss": float(self.updates)}, [[1]] * plan.dp_size)]


BASE = ["data.train_files=/d", "actor_rollout_ref.model.path=/m", "trainer.n_gpus_per_node=2",
        "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
        "data.max_prompt_length=8", "data.max_response_length=8", "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.old_log_prob_from_update=false", "algorithm.gamma=1.0", "algorithm.lam=1.0"]
SPLIT = ["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.hybrid_engine=False",
         "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
         "trainer.ballast_overlap.partial_rollout=false", "trainer.v1.separate_async.num_warmup_batches=0",
         "trainer.v1.separate_async.parameter_sync_step=4"]


def _trainer(*overrides):
    cfg = load_config(BASE + list(overrides))
    sizes = derive_sizes(cfg)
    trainer = object.__new__(RayPPOTrainer)
    trainer.cfg, trainer.sizes, trainer.workload, trainer.overlap = cfg, sizes, "tokens", overlap(cfg)
    trainer.old_log_probs = old_log_prob_source(cfg, sizes)
    trainer.correction = RolloutCorrectionPhase(trainer.old_log_probs.correction)
    trainer.kl_ctrl = make_kl_controller("fixed", 0.001, 0.1, 10000)
    trainer.actor_loss_cfg = actor_loss_config(cfg, trainer.old_log_probs)
    trainer.global_step, trainer._nonfinite_in_a_row = 0, 0
    trainer.monitor = BalanceMonitor(None, 10, False, 100, 256)
    trainer.workers = SimpleNamespace(actor_rollout=_Actor(), critic=_Critic(), objectives={})
    return trainer


def _batch(prompts=8, n=2, width=8):
    gen = torch.Generator().manual_seed(0)
    rows = prompts * n
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    response_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    attention = torch.cat([torch.ones(rows, 4, dtype=torch.long), response_mask], dim=1)
    ids = torch.randint(3, 50, (rows, 4 + width), generator=gen) * attention
    scores = torch.zeros(rows, width)
    scores[torch.arange(rows), lengths - 1] = torch.rand(rows, generator=gen)
    return Batch({"input_ids": ids, "attention_mask": attention, "responses": ids[:, 4:],
                  "response_mask": response_mask, "token_level_scores": scores},
                 non_tensors={"uid": np.repeat(np.arange(prompts), n).astype(str)})


@pytest.mark.parametrize("mode, calls", [
    ([], [(16, 4)]),                                         # sync: one update call, 8 / 2 = 4 mini-batches
    (["trainer.use_v1=false"], [(16, 4)]),                   # verl's legacy trainer: the same
    (["trainer.ballast_overlap.batches_ahead=1", "algorithm.rollout_correction.rollout_is=token",
      "actor_rollout_ref.rollout.calculate_log_probs=true"], [(16, 4)]),  # Ballast's overlap: the same step
    (SPLIT, [(4, 1)] * 4),                                   # separate_async P=4: four calls of one mini-batch
    ([*SPLIT, "actor_rollout_ref.actor.ppo_epochs=2"], [(4, 2)] * 4),
])
def test_update_calls_and_optimizer_steps_per_step_for_each_mode(mode, calls):
    trainer = _trainer(*mode)
    batch = _batch()
    if "rollout_log_probs" not in batch and trainer.correction.corr.rollout_is is not None:
        batch["rollout_log_probs"] = torch.full(batch["responses"].shape, -1.0)
    updates = trainer.local_updates(batch, True, {}, {})
    actor = trainer.workers.actor_rollout
    assert actor.calls == calls  # one scheduler step per call; optimizer steps: the mini-batches of each
    assert actor.optimizer_steps == sum(m for _, m in calls)
    assert actor.passes == [16]  # one old-log-prob pass, over the whole step, before any update
    assert trainer.workers.critic.updates == len(calls) == len(updates)
    assert [len(u.batch) for u in updates] == [16 // len(calls)] * len(calls)


def test_each_local_update_has_its_own_values_and_advantages():
    trainer = _trainer(*SPLIT)
    batch = _batch()
    updates = trainer.local_updates(batch, True, {}, {})
    for j, u in enumerate(updates):
        mask = u.batch["response_mask"].bool()
        # the critic had j updates when share j's values were computed (verl: values per local update)
        assert bool((u.batch["values"][mask] == float(j)).all())
        # GAE with gamma = lam = 1: advantage = the reward to come - the share's own value
        scores = u.batch["token_level_scores"]
        to_come = scores.flip(-1).cumsum(-1).flip(-1)
        assert torch.allclose(u.batch["returns"][mask], to_come[mask])
    metrics = merge_local_metrics([u.metrics for u in updates], [len(u.batch) for u in updates])
    assert metrics["actor/lr"] == 4.0 and metrics["critic/vf_loss"] == pytest.approx(2.5)  # last; mean of 1..4
    # one update over the whole batch (the old meaning of the key) saw only the untrained critic
    whole = _trainer(*SPLIT[:-1], "trainer.v1.separate_async.parameter_sync_step=1",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    [u] = whole.local_updates(_batch(), True, {}, {})
    assert bool((u.batch["values"] == 0.0).all()) and whole.workers.actor_rollout.calls == [(16, 1)]
