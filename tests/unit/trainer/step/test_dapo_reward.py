"""`reward_model.reward_manager=dapo` does what verl's DAPO manager does: a score function that returns a
plain number has it recorded as `acc` (before the overlong penalty), so dynamic sampling can filter on
`acc` and validation reports `acc` as its core variable; a dict result is recorded whole. The `naive`
manager records neither, and the config refuses the overlong buffer without the `dapo` manager."""

import numpy as np
import pytest
import torch

from ballast.protocol import Batch
from ballast.trainer.config import ConfigError, ModelInfo, load_config
from ballast.trainer.step.dynamic_sampling import filter_metric_values, informative_groups
from ballast.trainer.step.reward import OverlongBuffer, RewardManager
from ballast.trainer.run.run_plan import plan_run
from ballast.trainer.step.val_metrics import validation_metrics

MODEL = ModelInfo(num_attention_heads=4, num_key_value_heads=2, hidden_size=128, num_hidden_layers=2,
                  intermediate_size=256, vocab_size=300, max_position_embeddings=2048)


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


def _batch(lengths, width=4):
    """Responses of the given lengths; two prompts (uids u0, u1) with len(lengths) // 2 answers each."""
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    half = len(lengths) // 2
    return Batch({"responses": torch.ones(len(lengths), width, dtype=torch.long), "response_mask": mask},
                 {"data_source": ["gsm8k"] * len(lengths), "ground_truth": ["4"] * len(lengths),
                  "uid": np.array(["u0"] * half + ["u1"] * (len(lengths) - half), dtype=object)})


def _correct_if_short(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if len(solution_str) <= 2 else 0.0  # a plain number, as verl's GSM8K score returns


def test_dapo_manager_records_a_plain_number_as_acc_before_the_overlong_penalty():
    manager = RewardManager(_Tokenizer(), _correct_if_short, overlong=OverlongBuffer(4, 2, 1.0), manager="dapo")
    scores, extras = manager(_batch([2, 4, 3, 4]))
    assert extras["acc"].tolist() == [1.0, 0.0, 0.0, 0.0]
    # reward = acc + penalty: lengths 3 and 4 exceed max_response_length - len = 2 by 1 and 2 tokens
    assert scores.sum(-1).tolist() == [1.0, -1.0, -0.5, -1.0]
    # filtering on acc keeps the group whose answers differ in correctness; on reward it would keep both
    assert informative_groups(_batch([2, 4, 3, 4])["uid"], extras["acc"]).tolist() == [True, True, False, False]
    assert informative_groups(_batch([2, 4, 3, 4])["uid"], scores.sum(-1).numpy()).all()


def test_naive_manager_records_no_acc_so_filtering_on_acc_is_an_error():
    scores, extras = RewardManager(_Tokenizer(), _correct_if_short)(_batch([2, 4]))
    assert extras == {} and scores.sum(-1).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="filter_groups.metric='acc' is neither one of .* nor a value the score "
                                         "function returns"):
        filter_metric_values("acc", scores, extras)


def test_dapo_manager_records_a_dict_result_whole_and_naive_without_its_score():
    def scored(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "acc": True, "pred": "4", "format_ok": 1}

    _, dapo = RewardManager(_Tokenizer(), scored, manager="dapo")(_batch([1, 2]))
    _, naive = RewardManager(_Tokenizer(), scored)(_batch([1, 2]))
    assert sorted(dapo) == ["acc", "format_ok", "pred", "score"] and dapo["score"].tolist() == [0.5, 0.5]
    assert sorted(naive) == ["acc", "format_ok", "pred"] and naive["acc"].tolist() == [1.0, 1.0]


def test_validation_core_variable_is_acc_with_the_dapo_manager_and_reward_without():
    batch = _batch([2, 4, 1, 3])  # acc 1, 0 | 1, 0; overlong penalty 0, -1 | 0, -0.5
    for manager, core, mean in (("dapo", "acc", 0.5), ("naive", "reward", 0.5)):
        overlong = OverlongBuffer(4, 2, 1.0) if manager == "dapo" else None
        scores, extras = RewardManager(_Tokenizer(), _correct_if_short, overlong=overlong, manager=manager)(batch)
        infos = {"reward": scores.sum(-1).tolist(), **{k: v.tolist() for k, v in extras.items()}}
        metrics = validation_metrics(batch["data_source"], batch["uid"], infos)
        assert {key.split("/")[2] for key in metrics if key.startswith("val-core/")} == {core}
        assert metrics[f"val-core/gsm8k/{core}/mean@2"] == pytest.approx(mean)
    assert metrics.keys().isdisjoint({"val-aux/gsm8k/acc/mean@2"})
    assert validation_metrics(batch["data_source"], batch["uid"], {"reward": [1.0, -1.0, 1.0, -0.5]})[
        "val-core/gsm8k/reward/mean@2"] == pytest.approx(0.125)  # what the dapo run's reward (penalised) would report


def test_unknown_manager_is_refused():
    with pytest.raises(ValueError, match="reward_model.reward_manager='prime' is not one of"):
        RewardManager(_Tokenizer(), _correct_if_short, manager="prime")


BASE = ["data.train_files=/d.parquet", "actor_rollout_ref.model.path=/m", "trainer.n_gpus_per_node=2",
        "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "data.max_response_length=64", "algorithm.adv_estimator=grpo",
        "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=16", "trainer.device=cpu"]


def test_the_overlong_buffer_needs_the_dapo_manager():
    with pytest.raises(ConfigError, match="reward_model.overlong_buffer.enable=True is applied by "
                                          "reward_model.reward_manager=dapo only .*'naive'"):
        plan_run(load_config(BASE), MODEL, total_steps=10)
    plan_run(load_config(BASE + ["reward_model.reward_manager=dapo"]), MODEL, total_steps=10)


def test_the_built_in_gsm8k_score_gives_acc_under_the_dapo_manager():
    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    answers = ["so #### 42", "so #### 41"]
    width = max(map(len, answers))
    responses = torch.tensor([[ord(c) for c in a.ljust(width)] for a in answers])
    batch = Batch({"responses": responses, "response_mask": torch.ones_like(responses)},
                  {"data_source": ["openai/gsm8k"] * 2, "ground_truth": ["42", "42"]})
    scores, extras = RewardManager(Chars(), manager="dapo")(batch)  # no custom function: the GSM8K rule
    assert extras["acc"].tolist() == [1.0, 0.0] and scores.sum(-1).tolist() == [1.0, 0.0]
