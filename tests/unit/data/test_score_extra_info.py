"""What a score function's `extra_info` holds: the dataset row's keys, and verl's rollout keys with
verl's types over them (the rollout's value wins a clash); the row's own dict is never changed."""

import numpy as np
import pytest

from ballast.data import ROLLOUT_EXTRA_INFO_KEYS, score_extra_info


def test_the_rows_keys_are_kept_and_verls_keys_added_with_verls_types():
    row = {"split": "train", "index": 7, "count": 3}
    info = score_extra_info(row, num_turns=np.int64(6), tool_rewards=(0.5, np.float32(0.25), 1),
                            turn_scores=[])
    assert info == {"split": "train", "index": 7, "count": 3, "num_turns": 6, "tool_rewards": [0.5, 0.25, 1.0],
                    "turn_scores": [], "rollout_reward_scores": {}}
    assert type(info["num_turns"]) is int
    assert all(type(r) is float for r in info["tool_rewards"])
    assert type(info["turn_scores"]) is list and type(info["rollout_reward_scores"]) is dict
    assert set(ROLLOUT_EXTRA_INFO_KEYS) == {"num_turns", "tool_rewards", "turn_scores", "rollout_reward_scores"}


def test_a_row_without_extra_info_gets_the_rollout_keys_only():
    info = score_extra_info(None, num_turns=2, tool_rewards=[], turn_scores=[])
    assert info == {"num_turns": 2, "tool_rewards": [], "turn_scores": [], "rollout_reward_scores": {}}


def test_the_rollouts_value_wins_a_clash_and_the_rows_dict_is_not_changed():
    row = {"num_turns": "target", "tool_rewards": "mine", "kept": 1}
    first = score_extra_info(row, num_turns=4, tool_rewards=[1.0], turn_scores=[0.1, 0.2])
    second = score_extra_info(row, num_turns=2, tool_rewards=[], turn_scores=[])
    assert first["num_turns"] == 4 and first["tool_rewards"] == [1.0] and first["turn_scores"] == [0.1, 0.2]
    assert second["num_turns"] == 2 and second["tool_rewards"] == []  # the n samples of a prompt share `row`
    assert row == {"num_turns": "target", "tool_rewards": "mine", "kept": 1}
    assert first["kept"] == second["kept"] == 1
    first["tool_rewards"].append(9.0)
    assert second["tool_rewards"] == []


def test_extra_info_that_is_not_a_dict_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"extra_info must be a dict, got list \[1, 2\]"):
        score_extra_info([1, 2], num_turns=2, tool_rewards=[], turn_scores=[])
