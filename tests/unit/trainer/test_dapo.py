"""DAPO's data-side pieces: the overlong reward buffer and dynamic sampling (filter_groups)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ballast.protocol import Batch
from ballast.trainer.config import load_config
from ballast.trainer.dynamic_sampling import filter_metric_values, informative_groups
from ballast.trainer.ray_trainer import DynamicSamplingError, RayPPOTrainer
from ballast.trainer.reward import OverlongBuffer, RewardManager


def test_overlong_penalty_is_verls_linear_ramp():
    buf = OverlongBuffer(max_response_length=100, buffer_len=20, penalty_factor=0.5)
    # verl: min(-(L - (max - len)) / len * factor, 0)
    assert [buf.penalty(n) for n in (50, 80, 90, 100)] == [0.0, 0.0, pytest.approx(-0.25), pytest.approx(-0.5)]
    with pytest.raises(ValueError, match="overlong_buffer.len=0"):
        OverlongBuffer(max_response_length=100, buffer_len=0, penalty_factor=1.0)


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_reward_manager_adds_the_overlong_penalty_and_logs_it():
    lengths = [2, 4]
    mask = (torch.arange(4)[None] < torch.tensor(lengths)[:, None]).long()
    batch = Batch({"responses": torch.ones(2, 4, dtype=torch.long), "response_mask": mask},
                  {"data_source": ["x", "x"], "ground_truth": ["a", "a"]})
    manager = RewardManager(_Tokenizer(), lambda *a: 1.0, overlong=OverlongBuffer(4, 2, 1.0, log=True))
    scores, extras = manager(batch)
    assert scores[0, 1] == 1.0 and scores[1, 3] == pytest.approx(0.0)  # length 4 = max: 1 - 1.0
    assert extras["overlong_reward"].tolist() == [0.0, -1.0] and extras["overlong"].tolist() == [0.0, 1.0]


def test_groups_with_one_shared_value_are_dropped():
    uids = ["a", "a", "b", "b", "c"]
    values = np.array([1.0, 1.0, 0.0, 1.0, 1.0])
    assert informative_groups(uids, values).tolist() == [False, False, True, True, True]
    scores = torch.tensor([[0.0, 1.0], [0.0, 0.5]])
    assert filter_metric_values("reward", scores, {}).tolist() == [1.0, 0.5]
    assert filter_metric_values("acc", scores, {"acc": np.array([1, 0])}).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="filter_groups.metric='pred'"):
        filter_metric_values("pred", scores, {"acc": np.array([1, 0])})


def _trainer(overrides, rewards_per_call):
    """A RayPPOTrainer whose workers return canned rewards: prompts of batch k get rewards_per_call[k]."""
    cfg = load_config(["data.train_files=/d", "actor_rollout_ref.model.path=/m", "data.train_batch_size=2",
                       "actor_rollout_ref.rollout.n=2", "algorithm.filter_groups.enable=True"] + overrides)
    trainer = object.__new__(RayPPOTrainer)
    calls = SimpleNamespace(n=0, indices=[], prefixes=[])

    def generate_sequences(batch):
        calls.indices.append(batch.meta["rollout_call_index"])
        if len(calls.indices) == 1:  # the first generate of a step syncs the weights (per worker)
            batch.meta["metrics"] = {"timing_s/update_weights": [0.25, 0.5]}
        return batch

    def reward(batch, step=None):
        values = torch.tensor(rewards_per_call[calls.n], dtype=torch.float32)
        calls.n += 1
        return values[:, None].repeat(1, 3), {}

    def next_prompts(step, uid_prefix=None):
        calls.prefixes.append(uid_prefix)
        return Batch({"x": torch.zeros(2, 1)}, {"uid": np.array([f"{uid_prefix}-0", f"{uid_prefix}-1"], dtype=object)})

    trainer.cfg = cfg
    trainer._weight_sync_s = 0.0
    trainer.workers = SimpleNamespace(actor_rollout=SimpleNamespace(generate_sequences=generate_sequences))
    trainer.reward = reward
    trainer.data = SimpleNamespace(next_prompts=next_prompts)
    return trainer, calls


def test_dynamic_sampling_generates_until_the_batch_is_full():
    # call 1: prompt 0 all-equal (dropped), prompt 1 informative; call 2: both informative -> 3 groups, keep 2
    trainer, calls = _trainer([], [[1, 1, 0, 1], [0, 1, 1, 0]])
    prompts = Batch({"x": torch.zeros(2, 1)}, {"uid": np.array(["s-0", "s-1"], dtype=object)})
    metrics, timing = {}, {}
    batch = trainer.generate_and_score(prompts, 5, timing, metrics)
    assert len(batch) == 4 and list(batch["uid"]) == ["s-1", "s-1", "step5.gen1-0", "step5.gen1-0"]
    assert batch["token_level_scores"][:, 0].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert metrics["train/num_gen_batches"] == 2 and metrics["training/filter_groups/evicted_samples"] == 1
    # verl counts both in prompt groups: 1 group evicted, 1 informative group beyond train_batch_size=2
    assert metrics["training/filter_groups/discarded_surplus_samples"] == 1
    assert calls.indices[0] == 5 and calls.indices[1] != 5  # fresh sampling seeds for the extra batch
    assert timing["update_weights"] == 0.5 and timing["gen"] >= 0  # the slowest worker's weight sync, once


def test_dynamic_sampling_gives_up_after_max_num_gen_batches():
    trainer, _ = _trainer(["algorithm.filter_groups.max_num_gen_batches=2"], [[1, 1, 0, 0], [1, 1, 1, 1]])
    prompts = Batch({"x": torch.zeros(2, 1)}, {"uid": np.array(["s-0", "s-1"], dtype=object)})
    with pytest.raises(DynamicSamplingError, match="2 generation batches .* gave only 0 of data.train_batch_size=2"):
        trainer.generate_and_score(prompts, 1, {}, {})
