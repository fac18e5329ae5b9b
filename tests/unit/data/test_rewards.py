"""Reward functions on hand-made cases, the registry, score validation and custom reward loading."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ballast.data import rewards
from ballast.data.rewards import (
    default_compute_score,
    extract_gsm8k_answer,
    get_reward_fn,
    gsm8k_score,
    load_custom_reward_fn,
    register_reward_fn,
    repeat_score,
    validate_score,
)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("####", 1.0),  # exact
        ("  ####\n", 1.0),  # surrounding whitespace ignored
        ("", 0.0),
        ("   ", 0.0),
        ("##", 0.5),  # half the count, all correct characters
        ("########", 0.5),  # double the count
        ("abcd", 0.2),  # right length, no correct characters: the length weight only
        ("##ab", 0.6),  # right length, half correct: 0.2 + 0.8 * 0.5
        ("##ab##ab", 0.3),  # twice too long, half correct: (0.2 + 0.4) * 0.5
    ],
)
def test_repeat_score_hand_cases(response, expected):
    result = repeat_score("ballast/repeat", response, "####")
    assert result["score"] == pytest.approx(expected)
    assert 0.0 <= result["content"] <= 1.0 and 0.0 <= result["closeness"] <= 1.0


@settings(max_examples=200, deadline=None)
@given(
    symbol=st.sampled_from("#*@%"),
    count=st.integers(1, 200),
    response=st.text(alphabet="#*@% ab\n", max_size=300),
)
def test_repeat_score_is_bounded_and_one_only_for_the_exact_answer(symbol, count, response):
    score = repeat_score("ballast/repeat", response, symbol * count)["score"]
    assert 0.0 <= score <= 1.0
    assert (score == pytest.approx(1.0)) == (response.strip() == symbol * count)


def test_repeat_score_rejects_bad_ground_truth():
    with pytest.raises(ValueError, match="one character repeated"):
        repeat_score("ballast/repeat", "x", "#*")
    with pytest.raises(ValueError, match="one character repeated"):
        repeat_score("ballast/repeat", "x", "")


@pytest.mark.parametrize(
    "text, method, expected",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "strict", "7"),
        ("#### 1,000", "strict", "1000"),
        ("####  $42.", "strict", "42"),
        ("#### 2.50", "strict", "2.5"),
        ("#### -3", "strict", "-3"),
        ("the answer is 18", "strict", None),
        ("the answer is 18", "flexible", "18"),
        ("12 cups, then 1,250.00 total", "flexible", "1250"),
        ("#### 5 and later 9", "flexible", "5"),  # an explicit marker wins over the last number
        ("no numbers here", "flexible", None),
    ],
)
def test_extract_gsm8k_answer(text, method, expected):
    assert extract_gsm8k_answer(text, method=method) == expected


def test_gsm8k_score():
    assert gsm8k_score("openai/gsm8k", "so 6 * 3 = 18\n#### 18", "18") == 1.0
    assert gsm8k_score("openai/gsm8k", "#### 18.0", "18") == 1.0
    assert gsm8k_score("openai/gsm8k", "#### 17", "18") == 0.0
    assert gsm8k_score("openai/gsm8k", "#### 17", "18", format_score=0.1) == 0.1
    assert gsm8k_score("openai/gsm8k", "no answer", "18", format_score=0.1) == 0.0
    assert gsm8k_score("openai/gsm8k", "it is 18", "18", method="strict") == 0.0
    with pytest.raises(ValueError, match="ground_truth must be a number"):
        gsm8k_score("openai/gsm8k", "#### 1", "one")


def test_registry_dispatches_by_data_source(monkeypatch):
    assert default_compute_score("ballast/repeat", "##", "##")["score"] == 1.0
    assert default_compute_score("openai/gsm8k", "#### 4", "4") == 1.0
    with pytest.raises(ValueError, match="no reward function registered for data_source 'nope'.*ballast/repeat"):
        get_reward_fn("nope")
    monkeypatch.setattr(rewards, "_REGISTRY", dict(rewards._REGISTRY))
    register_reward_fn("mine", lambda *a, **k: 0.5)
    assert default_compute_score("mine", "x", "y") == 0.5
    with pytest.raises(ValueError, match="'mine' already has a reward function"):
        register_reward_fn("mine", lambda *a, **k: 0.0)
    with pytest.raises(TypeError, match="must be callable"):
        register_reward_fn("other", 3)


@pytest.mark.parametrize("value, expected", [(0.5, 0.5), (1, 1.0), ({"score": 0.25, "acc": True}, 0.25)])
def test_validate_score_accepts_finite_numbers_and_dicts(value, expected):
    out = validate_score(value, index=3, data_source="src")
    assert out["score"] == expected and isinstance(out["score"], float)
    if isinstance(value, dict):
        assert out["acc"] is True


@pytest.mark.parametrize(
    "value, match",
    [
        (math.nan, "must be finite, got nan"),
        (math.inf, "must be finite, got inf"),
        (True, "must be a finite number, got bool"),
        ("1.0", "must be a finite number, got str"),
        (None, "must be a finite number, got NoneType"),
        ({"acc": 1.0}, "dict without a 'score' key"),
        ({"score": math.nan}, "must be finite, got nan"),
    ],
)
def test_validate_score_names_row_and_data_source(value, match):
    with pytest.raises(ValueError, match=rf"row 7 \(data_source 'my/src'\).*{match}"):
        validate_score(value, index=7, data_source="my/src")


def test_load_custom_reward_fn(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "import dataclasses\n"
        "@dataclasses.dataclass\n"
        "class Cfg:\n    bonus: float = 0.0\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    return float(solution_str == ground_truth) + bonus\n"
        "NOT_A_FUNCTION = 3\n"
    )
    fn = load_custom_reward_fn(path, "compute_score")
    assert fn("d", "a", "a") == 1.0 and fn("d", "a", "b") == 0.0
    assert load_custom_reward_fn(path, "compute_score", bonus=0.5)("d", "a", "a") == 1.5
    with pytest.raises(ValueError, match=r"my_reward.py' has no function 'score_fn'; callables there: \['Cfg', 'compute_score'"):
        load_custom_reward_fn(path, "score_fn")
    with pytest.raises(ValueError, match="'NOT_A_FUNCTION' in custom reward file .*my_reward.py' is a int"):
        load_custom_reward_fn(path, "NOT_A_FUNCTION")
    with pytest.raises(FileNotFoundError, match="missing_reward.py' does not exist"):
        load_custom_reward_fn(tmp_path / "missing_reward.py", "compute_score")
    broken = tmp_path / "broken_reward.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(ImportError, match="broken_reward.py' failed: SyntaxError"):
        load_custom_reward_fn(broken, "compute_score")
