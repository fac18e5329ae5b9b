"""The calculator task: rows, held-out split, and a reward only the model's own answer can earn."""

from ballast.data import default_compute_score, make_tool_arithmetic_rows, read_rows, write_tool_arithmetic_dataset


def test_rows_are_tool_agent_conversations_with_a_one_shot_example():
    rows = make_tool_arithmetic_rows(8, seed=1)
    for row in rows:
        a, b = row["extra_info"]["operands"]
        assert 100 <= a <= 999 and 10 <= b <= 999 and row["reward_model"]["ground_truth"] == str(a * b)
        assert row["agent_name"] == "tool_agent" and [m["role"] for m in row["prompt"]] == [
            "system", "user", "assistant", "tool", "assistant", "user"]
        assert row["prompt"][-1]["content"] == f"What is {a} * {b}?"
    assert make_tool_arithmetic_rows(8, seed=1) == rows
    assert [m["role"] for m in make_tool_arithmetic_rows(1, one_shot=False)[0]["prompt"]] == ["system", "user"]


def test_val_split_is_held_out(tmp_path):
    paths = write_tool_arithmetic_dataset(tmp_path, train_size=200, val_size=20, seed=0)
    train = {r["prompt"][-1]["content"] for r in read_rows(paths["train"])}
    val = read_rows(paths["val"])
    assert len(val) == 20 and not train & {r["prompt"][-1]["content"] for r in val}


def test_reward_needs_the_models_answer_not_the_tool_result():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 86"}}</tool_call>'
    score = lambda text: default_compute_score("ballast/tool_arithmetic", text, "29842")
    assert score(call + "tool\n29842 Answer: 29,842")["score"] == 1.0
    assert score(call + "tool\n29842")["score"] == 0.0  # ended on the tool's result
    assert score("Answer: 29842 ... Answer: 3")["score"] == 0.0  # the last answer counts
    out = score("347 * 86 = 29842")
    assert out == {"score": 0.0, "answered": 0.0, "called_tool": 0.0}
