"""The driver's scores-to-advantages phase without verl: the KL penalty in the reward is taken over the
response mask as generated, before decoupled rollout correction rejects anything, so a rejected row
still pays its penalty, counts toward the controller's KL and keeps its place in its group."""

import contextlib

import numpy as np
import pytest
import torch

from ballast.protocol import Batch
from ballast.trainer.algorithms import make_kl_controller
from ballast.trainer.config import load_config
from ballast.trainer.step.advantage_phase import rewards_and_advantages
from ballast.trainer.step.rollout_correction import RolloutCorrectionPhase, rollout_correction_settings

RC = "algorithm.rollout_correction"


def test_a_rejected_row_pays_its_kl_penalty_and_stays_in_its_group():
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 1, 1], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]], dtype=torch.float32)
    scores = torch.zeros(4, 5)
    scores[torch.arange(4), torch.tensor([3, 4, 3, 4])] = torch.tensor([1.0, 0.0, 0.5, 1.0])
    old = -torch.rand(4, 5, generator=gen)
    ref = old - 0.5 * torch.rand(4, 5, generator=gen)  # kl = old - ref > 0 on every token
    rollout = old + 0.01 * torch.randn(4, 5, generator=gen)
    rollout[1] = old[1] + 3.0  # far off: sequence-level rejection drops row 1
    batch = Batch({"response_mask": mask.clone(), "token_level_scores": scores, "old_log_probs": old,
                   "ref_log_prob": ref, "rollout_log_probs": rollout * mask},
                  {"uid": np.array(["p"] * 4, dtype=object)})
    cfg = load_config(["data.train_files=x", "actor_rollout_ref.model.path=m",
                       "actor_rollout_ref.rollout.calculate_log_probs=True", "algorithm.adv_estimator=grpo",
                       "algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.type=fixed",
                       "algorithm.kl_ctrl.kl_coef=0.5", f"{RC}.rollout_rs=seq_mean_k1",
                       f"{RC}.rollout_rs_threshold=0.5_2.0"])
    kl_ctrl = make_kl_controller("fixed", 0.5, 0.0, 1)
    metrics = rewards_and_advantages(batch, cfg.algorithm, kl_ctrl, RolloutCorrectionPhase(rollout_correction_settings(cfg)),
                                     lambda name: contextlib.nullcontext())
    assert batch["response_mask"][1].sum() == 0 and torch.equal(batch["response_mask"][[0, 2, 3]], mask[[0, 2, 3]])
    kld = (old - ref) * mask  # over the mask as generated, row 1 included
    torch.testing.assert_close(batch["token_level_rewards"], scores - 0.5 * kld)
    per_row = kld.sum(1) / mask.sum(1)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(float(per_row.mean()), rel=1e-6)
    totals = (scores - 0.5 * kld).sum(1)  # the group's statistics include the rejected row's reward
    expected = (totals - totals.mean()) / (totals.std() + 1e-6)
    for row in (0, 2, 3):
        kept = batch["advantages"][row][mask[row] == 1]
        torch.testing.assert_close(kept, expected[row].expand_as(kept), rtol=1e-5, atol=1e-6)
    assert torch.all(batch["advantages"][1] == 0)
