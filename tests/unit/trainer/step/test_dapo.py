"""DAPO's data-side pieces: the overlong reward buffer and dynamic sampling (filter_groups)."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ballast.protocol import Batch, Output
from ballast.workers.rollout.prompts import prompt_token_lists
from ballast.trainer.config import load_config
from ballast.trainer.run.data import DataExhausted
from ballast.trainer.step.dynamic_sampling import filter_metric_values, informative_groups
from ballast.trainer.ray_trainer import DynamicSamplingError, RayPPOTrainer
from ballast.trainer.step.reward import OverlongBuffer, RewardManager
from ballast.trainer.step.rollout_weights import RolloutWeights
from ballast.workers.spec import GenerateArgs
from ballast.trainer.step.rollout_pipeline import (STALENESS, Ahead, PendingRollout, load_rollouts_ahead,
                                                   save_rollouts_ahead, staleness_metrics)

from testkit.prompts import left_padded_prompts
from testkit.rollout import rollout_output

PAD = 9


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


def _trainer(overrides, rewards_per_call, make_prompts=None, rollout=None):
    """A RayPPOTrainer whose workers return canned rewards: prompts of batch k get rewards_per_call[k].

    `make_prompts(uid_prefix)` builds the prompts of each further generation batch and `rollout(batch)`
    stands for the rollout workers (default: prompts echoed back without responses)."""
    cfg = load_config(["data.train_files=/d", "actor_rollout_ref.model.path=/m", "data.train_batch_size=2",
                       "actor_rollout_ref.rollout.n=2", "algorithm.filter_groups.enable=True"] + overrides)
    trainer = object.__new__(RayPPOTrainer)
    calls = SimpleNamespace(n=0, indices=[], prefixes=[])

    def generate_sequences(batch, call=GenerateArgs()):
        calls.indices.append(call.call_index)
        if rollout is not None:
            batch = rollout(batch)
        synced = {"timing_s/update_weights": [0.25, 0.5]} if len(calls.indices) == 1 else {}
        return Output(batch, synced)  # the first generate of a step syncs the weights (per worker)

    def reward(batch, step=None):
        values = torch.tensor(rewards_per_call[calls.n], dtype=torch.float32)
        calls.n += 1
        return values[:, None].repeat(1, 3), {}

    def next_prompts(step, uid_prefix=None):
        calls.prefixes.append(uid_prefix)
        if make_prompts is not None:
            return make_prompts(uid_prefix)
        return Batch({"x": torch.zeros(2, 1)}, {"uid": np.array([f"{uid_prefix}-0", f"{uid_prefix}-1"], dtype=object)})

    trainer.cfg = cfg
    trainer._weights_version = 0
    def submit(method, *args):  # the group's non-blocking call: the future's get() runs it
        return SimpleNamespace(get=lambda timeout_s=None: getattr(rollout_group, method)(*args))

    rollout_group = SimpleNamespace(generate_sequences=generate_sequences, submit=submit)
    trainer.workers = SimpleNamespace(actor_rollout=rollout_group, generator=rollout_group, rollout=None)
    trainer.rollout_weights = RolloutWeights(trainer.workers)
    trainer.reward = reward
    trainer.data = SimpleNamespace(next_prompts=next_prompts, pad_token_id=PAD)
    return trainer, calls


def _take(trainer, prompts, step, version=None):
    """A step's rollout as the trainer takes it: generated from `prompts` by weights `version` (default:
    the latest, step - 1), scored on the pipeline's thread, then filled on the main thread."""
    first = trainer.workers.actor_rollout.generate_sequences(
        prompts.repeat(trainer.cfg.actor_rollout_ref.rollout.n, interleave=True), GenerateArgs(call_index=step))
    version = step - 1 if version is None else version
    pending = PendingRollout(step, version, SimpleNamespace(get=lambda: first), time.perf_counter())
    trainer._weights_version = step - 1
    return trainer.fill_groups(trainer.finish_rollout(pending))


def _generate_and_score(trainer, prompts, step):
    """(batch, timing, metrics) of `_take`."""
    rollout = _take(trainer, prompts, step)
    return rollout.batch, rollout.timing, rollout.metrics


def test_dynamic_sampling_generates_until_the_batch_is_full():
    # call 1: prompt 0 all-equal (dropped), prompt 1 informative; call 2: both informative -> 3 groups, keep 2
    trainer, calls = _trainer([], [[1, 1, 0, 1], [0, 1, 1, 0]])
    prompts = Batch({"x": torch.zeros(2, 1)}, {"uid": np.array(["s-0", "s-1"], dtype=object)})
    batch, timing, metrics = _generate_and_score(trainer, prompts, 5)
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
        _generate_and_score(trainer, prompts, 1)


def _prompts(token_lists, uid_prefix):
    """Prompts as the data loader collates them: left-padded to the batch's own longest prompt."""
    layout = left_padded_prompts(token_lists, pad=PAD, position_ids=True)
    return Batch(dict(layout.items()), {"uid": np.array([f"{uid_prefix}-{i}" for i in range(len(token_lists))],
                                                        dtype=object)})


def _rollout(batch):
    """The rollout's output contract for `batch`: each prompt answered with its first token and 1."""
    answers = [[tokens[0], 1] for tokens in prompt_token_lists(batch["input_ids"], batch["attention_mask"])]
    out = rollout_output(batch["input_ids"], batch["attention_mask"], answers, pad_token_id=PAD, response_length=3)
    return Batch(dict(out.items()), batch.non_tensors, batch.meta)


def test_dynamic_sampling_combines_generation_batches_of_different_prompt_widths():
    # batch 1: prompts of width 2 (one informative group); batch 2: width 4 (both informative)
    further = {"step3.gen1": [[40, 41, 42, 43], [50, 51]]}
    trainer, _ = _trainer([], [[1, 1, 0, 1], [0, 1, 1, 0]], make_prompts=lambda prefix: _prompts(further[prefix], prefix),
                          rollout=_rollout)
    batch, _, _ = _generate_and_score(trainer, _prompts([[20, 21], [30]], "s"), 3)
    assert list(batch["uid"]) == ["s-1", "s-1", "step3.gen1-0", "step3.gen1-0"]
    assert batch["prompts"].shape == (4, 4) and batch["input_ids"].shape == (4, 7)
    prompts = prompt_token_lists(batch["prompts"], batch["attention_mask"][:, :4])
    assert prompts == [[30], [30], [40, 41, 42, 43], [40, 41, 42, 43]]
    assert batch["responses"][:, :2].tolist() == [[30, 1], [30, 1], [40, 1], [40, 1]]
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], dim=1))
    assert batch["position_ids"][0].tolist() == [0, 0, 0, 0, 1, 2, 3]  # one prompt token, then the response
    assert batch["response_mask"].sum().item() == 8 and batch["attention_mask"].sum().item() == 8 + 1 + 1 + 4 + 4


def test_running_out_of_data_mid_step_names_the_groups_left_untrained():
    def no_more(prefix):
        raise DataExhausted("the training data of trainer.total_epochs=1 is used up")

    trainer, _ = _trainer([], [[1, 1, 0, 1]], make_prompts=no_more)
    prompts = Batch({"x": torch.zeros(2, 1)}, {"uid": np.array(["s-0", "s-1"], dtype=object)})
    with pytest.raises(DataExhausted, match="total_epochs=1 is used up; the 1 of data.train_batch_size=2 prompt "
                                            "groups collected from 1 generation batches are not trained on"):
        _generate_and_score(trainer, prompts, 4)


def test_an_ahead_batch_short_of_groups_is_filled_with_the_latest_weights():
    # off-policy overlap (k=2): step 5's first batch was generated by version 2 and keeps one group;
    # the further batch runs when step 5 is taken, with version 4, the weights after step 4
    trainer, calls = _trainer([], [[1, 1, 0, 1], [0, 1, 1, 1]])
    prompts = Batch({"x": torch.zeros(2, 1)}, {"uid": np.array(["s-0", "s-1"], dtype=object)})
    first = trainer.workers.actor_rollout.generate_sequences(prompts.repeat(2, interleave=True),
                                                             GenerateArgs(call_index=5))
    pending = PendingRollout(5, 2, SimpleNamespace(get=lambda: first), time.perf_counter())
    trainer._weights_version = 2
    short = trainer.finish_rollout(pending)  # the pipeline's thread: no generation beyond the launched one
    assert short.batch is None and short.unfilled is not None and len(calls.indices) == 1
    trainer._weights_version = 4
    rollout = trainer.fill_groups(short)
    assert list(rollout.batch["uid"]) == ["s-1", "s-1", "step5.gen1-0", "step5.gen1-0"]
    assert rollout.row_versions().tolist() == [2, 2, 4, 4] and rollout.unfilled is None
    ages = staleness_metrics(rollout, 5)
    assert (ages[f"{STALENESS}/max"], ages[f"{STALENESS}/min"], ages[f"{STALENESS}/mean"]) == (2.0, 0.0, 1.0)
    assert rollout.metrics["train/num_gen_batches"] == 2


def test_a_short_ahead_batch_survives_a_checkpoint(tmp_path):
    trainer, _ = _trainer([], [[1, 1, 0, 1], [0, 1, 1, 1]])
    prompts = Batch({"x": torch.zeros(2, 1)}, {"uid": np.array(["s-0", "s-1"], dtype=object)})
    first = trainer.workers.actor_rollout.generate_sequences(prompts.repeat(2, interleave=True),
                                                             GenerateArgs(call_index=3))
    short = trainer.finish_rollout(PendingRollout(3, 1, SimpleNamespace(get=lambda: first), time.perf_counter()))
    save_rollouts_ahead(str(tmp_path), Ahead([short]))
    (restored,) = load_rollouts_ahead(str(tmp_path)).rollouts
    trainer._weights_version = 2
    rollout = trainer.fill_groups(restored)
    assert list(rollout.batch["uid"]) == ["s-1", "s-1", "step3.gen1-0", "step3.gen1-0"]
    assert rollout.row_versions().tolist() == [1, 1, 2, 2]
