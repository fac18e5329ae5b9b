"""The code-execution reward: verl's test-case shapes, pass rate and all-pass, program extraction, the
coding task's rows, and the trainer's start-up check that refuses code rows where nothing can isolate them."""

import json
import types

import pytest

from ballast.data import default_compute_score, read_rows
from ballast.data.code_reward import CodeReward, extract_program, parse_test_cases
from ballast.data.coding import DATA_SOURCE, make_coding_rows, write_coding_dataset

ADD7 = json.dumps({"fn_name": "f", "inputs": ["3", "-4", "0"], "outputs": ["10", "3", "7"]})


def answer(body: str) -> str:
    return f"Here it is:\n```python\n{body}\n```\n"


@pytest.fixture(scope="module")
def all_pass():
    return CodeReward(mode="all_pass", test_timeout_s=5, max_concurrency=1)


def test_pass_rate_counts_hidden_tests_and_the_reasons():
    ok = default_compute_score(DATA_SOURCE, answer("def f(x):\n    return x + 7"), ADD7)
    assert (ok["score"], ok["tests_passed"]) == (1.0, 3.0)
    partial = default_compute_score(DATA_SOURCE, answer("def f(x):\n    return 7 if x == 0 else x + 7 if x > 0 else 0"), ADD7)
    assert partial["score"] == pytest.approx(2 / 3) and partial["wrong_answers"] == 1.0
    crash = default_compute_score(DATA_SOURCE, answer("def f(x):\n    return x / 0"), ADD7)
    assert (crash["score"], crash["runtime_errors"]) == (0.0, 3.0)
    none = default_compute_score(DATA_SOURCE, "def f(x): return x + 7", ADD7)
    assert (none["score"], none["no_code"]) == (0.0, 1.0)
    stdin = {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}
    assert default_compute_score("apps", answer("a, b = map(int, input().split())\nprint(a + b)"), stdin)["score"] == 1.0
    asserts = {"assert_case": ["assert f(1) == 8", "assert f(2) == 10"]}
    assert default_compute_score("taco", answer("def f(x):\n    return x + 7"), asserts)["pass_rate"] == 0.5
    method = json.dumps({"fn_name": "twice", "inputs": ["[1, 2]"], "outputs": ["[1, 2, 1, 2]"]})
    assert default_compute_score("ballast/code", answer("class Solution:\n    def twice(self, x):\n        return x * 2"),
                                 method)["score"] == 1.0


def test_all_pass_scores_one_only_when_every_test_passes_and_stops_at_the_first_failure(all_pass):
    assert all_pass(DATA_SOURCE, answer("def f(x):\n    return x + 7"), ADD7)["score"] == 1.0
    first_wrong = all_pass(DATA_SOURCE, answer("def f(x):\n    return x + 8"), ADD7)
    assert first_wrong["score"] == 0.0 and first_wrong["pass_rate"] == 0.0
    assert first_wrong["wrong_answers"] == 1.0  # with one slot the other two were never run


def test_timeouts_are_per_test():
    reward = CodeReward(test_timeout_s=1, max_concurrency=2)
    slow = reward(DATA_SOURCE, answer("import time\ndef f(x):\n    time.sleep(x)\n    return x + 7"),
                  json.dumps({"fn_name": "f", "inputs": ["0", "30"], "outputs": ["7", "37"]}))
    assert (slow["pass_rate"], slow["timeouts"]) == (0.5, 1.0)


@pytest.mark.parametrize("truth, why", [("{", "not valid JSON"), ("[1]", "must be a dict"),
                                        ({"inputs": ["1"], "outputs": []}, "must match"),
                                        ({"inputs": [], "outputs": []}, "non-empty"),
                                        ({"fn_name": "1x", "inputs": ["1"], "outputs": ["1"]}, "identifier")])
def test_bad_test_cases_name_the_problem(truth, why):
    with pytest.raises(ValueError, match=why):
        parse_test_cases(truth)
    assert parse_test_cases(ADD7)[1] == "f"


def test_program_extraction_follows_verl():
    assert extract_program("a\n```python\nx = 1\n```\nb\n```python\ny = 2\n```") == "\ny = 2\n"
    assert extract_program("```py\nz = 3\n```") == "z = 3\n"
    assert extract_program("no block") is None
    with pytest.raises(ValueError, match="mode"):
        CodeReward(mode="best")


def test_coding_rows_are_verl_format_with_held_out_requests(tmp_path):
    paths = write_coding_dataset(tmp_path, train_size=24, val_size=8, seed=3)
    train, val = read_rows(paths["train"]), read_rows(paths["val"])
    assert len(train) == 24 and len(val) == 8
    assert not {r["prompt"][-1]["content"] for r in val} & {r["prompt"][-1]["content"] for r in train}
    row = make_coding_rows(1, seed=1)[0]
    assert row["data_source"] == DATA_SOURCE and row["prompt"][0]["role"] == "system"
    cases, fn_name = parse_test_cases(row["reward_model"]["ground_truth"])
    assert fn_name == "f" and len(cases) == 5


def test_start_up_refuses_code_rows_without_the_sandbox(monkeypatch):
    from ballast.data import code_reward
    from ballast.tools import SandboxUnavailableError

    def unavailable():
        raise SandboxUnavailableError("the code-execution reward ... cannot be set up here: the bwrap binary")

    monkeypatch.setattr(code_reward, "default_code_reward", unavailable)
    assert code_reward.check_code_sandbox({"openai/gsm8k"}) == []  # no code rows: nothing to isolate
    with pytest.raises(SandboxUnavailableError, match="bwrap binary"):
        code_reward.check_code_sandbox({"openai/gsm8k", "ballast/code"})
