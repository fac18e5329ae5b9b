"""GRPO against a discriminative reward model (colocated, resident): two steps of the tiny run, the
reward the weighted sum of the rule score and the reward model's, each logged."""

import math

import numpy as np
import pytest


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from ballast.models import tiny_model_dir
    from ballast.models.reward_model import save_reward_model

    path = str(tmp_path_factory.mktemp("rm"))
    save_reward_model(tiny_model_dir(), path, seed=1, head_std=0.5)
    return path


def test_grpo_with_a_reward_model(session, rm_dir):
    with session("rm", "reward.reward_model.enable=True", f"reward.reward_model.model_path={rm_dir}",
                 "reward.reward_model.rule_weight=0.5", "reward.reward_model.forward_max_token_len_per_gpu=96",
                 "trainer.test_freq=2", "trainer.val_before_train=true") as trainer:
        assert trainer.workers.reward_model.world_size == 2  # beside the two trainer workers
        final = trainer.fit()
    for key in ("reward_extra/rm_score/mean", "reward_extra/rule_score/mean", "reward_extra/rm_truncated/mean",
                "critic/score/mean", "actor/pg_loss", "actor/grad_norm", "val/score/mean"):
        assert math.isfinite(final[key]), (key, final)
    want = 0.5 * final["reward_extra/rule_score/mean"] + final["reward_extra/rm_score/mean"]
    assert np.isclose(final["critic/score/mean"], want, atol=1e-5)
    assert final["reward_extra/rm_truncated/mean"] == 0.0
    assert final["reward_extra/rm_score/mean"] != 0.0
