"""Where the old policy's log-probs come from (`OldLogProbSource`): decided once, with the rollout-
correction settings parsed once inside it, and, in bypass mode, read from the column that holds them.

The run is planned (`plan_run`) and the driver built from the plan as `training_session` does, with
stand-in workers; the bypass step goes through the driver's own phases up to the actor update, and the
loss the worker specs were built with runs on exactly the columns the worker would hand it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ballast.engine.losses import GlobalNorm
from ballast.protocol import Batch
from ballast.protocol.fields import ACTOR_LOSS, columns_read_by
from ballast.trainer.algorithms.kl import kl_penalty
from ballast.trainer.config import load_config
from ballast.trainer.config.model_info import ModelInfo
from ballast.trainer.ray_trainer import RayPPOTrainer
from ballast.trainer.run.run_plan import plan_run
from ballast.trainer.step import rollout_correction
from ballast.workers.actor_rollout_ref import engine_input
from ballast.workers.on_policy import OldLogProbMode
from ballast.workers.train_loop import UpdateResult

TINY = ModelInfo(4, 2, 128, 2, 256, 512, 2048)
RC = "algorithm.rollout_correction"
BASE = ["data.train_files=/d.parquet", "actor_rollout_ref.model.path=/m", "trainer.n_gpus_per_node=2",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
        "data.max_prompt_length=8", "data.max_response_length=8", "algorithm.adv_estimator=grpo",
        "trainer.balance_workload=tokens", "actor_rollout_ref.rollout.calculate_log_probs=true"]
BYPASS = [f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=token",
          "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.5"]
REF_LOG_PROB = -1.0


class _ActorGroup:
    """Records what the driver hands the actor update; the reference's log-probs are a constant."""

    def __init__(self) -> None:
        self.updates = []

    def compute_log_prob(self, batch, plan):
        raise AssertionError("bypass mode runs no old-log-prob pass")

    def compute_ref_log_prob(self, batch, plan):
        return Batch({"ref_log_prob": torch.full(batch["responses"].shape, REF_LOG_PROB)})

    def update_actor(self, batch, plan, mode, rest):
        self.updates.append((batch, mode))
        return [UpdateResult({"actor/pg_loss": 0.0}, [[1] * len(plan.mini_batches)] * plan.dp_size)]


def _driver(*overrides):
    """(the plan, the driver built from it as `training_session` does, its stand-in actor group)."""
    cfg = load_config(BASE + list(overrides))
    plan = plan_run(cfg, TINY, total_steps=10)
    actor = _ActorGroup()
    workers = SimpleNamespace(actor_rollout=actor, critic=None, rollout=None, objectives={}, num_devices=2)
    data = SimpleNamespace(total_steps=10, next_prompts=None)  # no step is launched
    return plan, RayPPOTrainer(cfg, plan.sizes, data, workers, None, None, {}, plan.old_log_probs), actor


def _batch(rows=8, width=8):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    response_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    attention = torch.cat([torch.ones(rows, 4, dtype=torch.long), response_mask], dim=1)
    ids = torch.randint(3, 50, (rows, 4 + width), generator=gen) * attention
    scores = torch.zeros(rows, width)
    scores[torch.arange(rows), lengths - 1] = torch.rand(rows, generator=gen)
    rollout = -torch.rand(rows, width, generator=gen) * 2 * response_mask
    return Batch({"input_ids": ids, "attention_mask": attention, "responses": ids[:, 4:],
                  "response_mask": response_mask, "token_level_scores": scores, "rollout_log_probs": rollout},
                 non_tensors={"uid": np.repeat(np.arange(rows // 2), 2).astype(str)})


@pytest.mark.parametrize("overrides", [[], BYPASS, [f"{RC}.rollout_is=token"]])
def test_the_settings_are_parsed_once_for_the_whole_run(overrides, monkeypatch):
    calls = []
    parse = rollout_correction.parse_rollout_correction
    monkeypatch.setattr(rollout_correction, "parse_rollout_correction",
                        lambda *args, **kwargs: calls.append(args) or parse(*args, **kwargs))
    plan, trainer, _ = _driver(*overrides)
    assert len(calls) == 1  # the worker specs' loss and the driver's phases share the one parse
    assert trainer.old_log_probs is plan.old_log_probs
    assert trainer.correction.corr is plan.old_log_probs.correction
    assert trainer.actor_loss_cfg.rollout_correction is plan.old_log_probs.loss_correction
    assert plan.specs.actor_rollout_ref.actor_train.loss_fn.keywords["cfg"] == trainer.actor_loss_cfg


def test_each_setting_decides_the_source_and_its_columns():
    plan = plan_run(load_config(BASE + BYPASS), TINY, total_steps=10)
    source = plan.old_log_probs
    assert source.mode is OldLogProbMode.ROLLOUT and source.bypass
    assert (source.column, source.actor_column) == ("rollout_log_probs", "train_log_probs")
    assert not source.runs_pass(updates_actor=False)  # no pass anywhere, even without an actor update
    decoupled = plan_run(load_config(BASE + [f"{RC}.rollout_is=token"]), TINY, total_steps=10).old_log_probs
    assert decoupled.mode is OldLogProbMode.PASS and decoupled.column == decoupled.actor_column == "old_log_probs"
    plain = plan_run(load_config(BASE), TINY, total_steps=10).old_log_probs
    assert plain.mode is OldLogProbMode.PARTIAL and plain.update_mode(separate_pass=True) is OldLogProbMode.PASS
    assert plain.runs_pass(updates_actor=False) and not plain.runs_pass(updates_actor=True)


def test_a_bypass_step_has_no_old_log_probs_and_the_loss_reads_the_rollouts():
    plan, trainer, actor = _driver(*BYPASS)
    batch = _batch()
    trainer.local_updates(batch, True, {}, {})
    [(handed, mode)] = actor.updates
    assert mode is OldLogProbMode.ROLLOUT
    assert "old_log_probs" not in batch and "old_log_probs" not in handed  # no column holds the rollout's as "old"
    # the reward KL measured the rollout policy (the old one here) against the reference
    kld = kl_penalty(batch["rollout_log_probs"], torch.full_like(batch["rollout_log_probs"], REF_LOG_PROB), "kl")
    want = batch["token_level_scores"] - 0.5 * kld * batch["response_mask"]
    torch.testing.assert_close(batch["token_level_rewards"], want)
    # the loss the worker specs carry, on exactly the columns the worker hands it
    loss_fn = plan.specs.actor_rollout_ref.actor_train.loss_fn
    micro = engine_input(handed, columns_read_by(ACTOR_LOSS))
    gen = torch.Generator().manual_seed(1)
    outputs = {"log_probs": micro["rollout_log_probs"] + 0.1 * torch.randn(micro["responses"].shape, generator=gen),
               "entropy": torch.zeros(micro["responses"].shape)}
    norm = GlobalNorm.local(micro["response_mask"])
    loss, _ = loss_fn(outputs, micro, norm)
    shifted = micro.clone()
    shifted["rollout_log_probs"] = micro["rollout_log_probs"] - 1.0  # other rollout log-probs: other IS weights
    assert torch.isfinite(loss) and not torch.allclose(loss_fn(outputs, shifted, norm)[0], loss)
