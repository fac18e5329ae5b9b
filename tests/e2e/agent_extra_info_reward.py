"""The tool-agent e2e run's score function: the repeat task's score, after checking that extra_info
holds the dataset row's own keys (with this row's values) and verl's rollout keys with verl's types,
consistent with one another; it returns what it saw, so the test compares it with the agent metrics."""

from ballast.data import repeat_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the dataset row's keys (ballast.data.synthetic), with this row's values
    assert extra_info["symbol"] == ground_truth[0] and extra_info["count"] == len(ground_truth), extra_info
    assert extra_info["split"] in ("train", "val") and type(extra_info["index"]) is int, extra_info
    turns, rewards, scores = extra_info["num_turns"], extra_info["tool_rewards"], extra_info["turn_scores"]
    assert type(turns) is int and type(rewards) is list and type(scores) is list, extra_info
    assert all(type(r) is float for r in rewards) and scores == [], extra_info
    assert extra_info["rollout_reward_scores"] == {}, extra_info
    # verl's count, assistant + tool turns + 1, with one call per tool turn (max_parallel_calls=1): every
    # answered call got a tool turn, except the last one when its result did not fit the budget
    tool_turns, rest = divmod(turns - 2, 2)
    assert rest == 0 and tool_turns in (len(rewards), len(rewards) - 1), extra_info
    score = repeat_score(data_source, solution_str, ground_truth)["score"]
    return {"score": score, "seen_num_turns": float(turns), "seen_tool_calls": float(len(rewards))}
