"""The synthetic repeat task: verl row format, determinism, long-tailed ideal lengths, symbols that
are single tokens, and a reward that is not flat for a random policy (dense GRPO signal)."""

import numpy as np
import pytest

from ballast.data import RLDataset, read_rows, repeat_score
from ballast.data.synthetic import DEFAULT_SYMBOLS, PROMPT_TEMPLATE, length_stats, make_repeat_rows, write_repeat_dataset
from ballast.models.corpus import TASK_SYMBOLS


def test_rows_follow_verls_format():
    rows = make_repeat_rows(20, seed=0)
    for i, row in enumerate(rows):
        info = row["extra_info"]
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == "ballast/repeat"
        assert row["prompt"] == [{"role": "user", "content": PROMPT_TEMPLATE.format(symbol=info["symbol"], count=info["count"])}]
        assert row["reward_model"] == {"style": "rule", "ground_truth": info["symbol"] * info["count"]}
        assert info["split"] == "train" and info["index"] == i
        assert info["symbol"] in DEFAULT_SYMBOLS


def test_deterministic_and_splits_differ():
    assert make_repeat_rows(50, seed=1) == make_repeat_rows(50, seed=1)
    assert make_repeat_rows(50, seed=1) != make_repeat_rows(50, seed=2)
    train = [r["reward_model"] for r in make_repeat_rows(50, seed=1, split="train")]
    val = [r["reward_model"] for r in make_repeat_rows(50, seed=1, split="val")]
    assert train != val


def test_ideal_lengths_are_long_tailed_and_bounded():
    for seed in range(3):
        rows = make_repeat_rows(400, seed=seed)
        stats = length_stats(rows)
        assert stats["max_over_median"] >= 4, stats
        assert 1 <= stats["min"] and stats["max"] <= 192
        assert stats["mean"] > stats["median"]  # right-skewed


def test_count_bounds_and_bad_arguments():
    rows = make_repeat_rows(300, seed=0, k_median=8, k_sigma=2.0, k_min=3, k_max=40)
    counts = [r["extra_info"]["count"] for r in rows]
    assert min(counts) == 3 and max(counts) == 40
    with pytest.raises(ValueError, match="k_min=5, k_max=4"):
        make_repeat_rows(3, k_min=5, k_max=4)
    with pytest.raises(ValueError, match="symbols must be"):
        make_repeat_rows(3, symbols="ab")
    with pytest.raises(ValueError, match="num_rows must be >= 0"):
        make_repeat_rows(-1)


def test_symbols_are_single_tokens_and_runs_do_not_merge(tokenizer):
    assert set(DEFAULT_SYMBOLS) <= set(TASK_SYMBOLS)
    for row in make_repeat_rows(30, seed=0):
        truth = row["reward_model"]["ground_truth"]
        assert len(tokenizer(truth, add_special_tokens=False)["input_ids"]) == len(truth)


def test_written_parquet_loads_into_the_dataset(tokenizer, tmp_path):
    paths = write_repeat_dataset(tmp_path, train_size=40, val_size=8, seed=3)
    assert read_rows(paths["train"]) == make_repeat_rows(40, seed=3, split="train")
    val = RLDataset(paths["val"], tokenizer, max_prompt_length=64)
    assert len(val) == 8 and val.stats.max_prompt_tokens_seen <= 32
    assert {s["extra_info"]["split"] for s in val} == {"val"}


def test_random_policy_reward_is_not_flat(tokenizer):
    """Uniform random tokens until eos (what a random-init model roughly samples): every GRPO group
    of 4 must have score spread, or GRPO would see zero advantages at step one."""
    rng = np.random.default_rng(0)
    rows = make_repeat_rows(48, seed=0)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    scores = np.zeros((len(rows), 4))
    for i, row in enumerate(rows):
        for j in range(4):
            ids = rng.integers(0, vocab, size=128)
            stops = np.flatnonzero(ids == eos)
            text = tokenizer.decode(ids[: stops[0]] if stops.size else ids, skip_special_tokens=True)
            scores[i, j] = repeat_score("ballast/repeat", text, row["reward_model"]["ground_truth"])["score"]
    within_group_std = scores.std(axis=1)
    assert np.mean(within_group_std > 0) >= 0.95
    assert within_group_std.mean() > 0.3 * scores.mean() > 0  # spread comparable to the level
    assert scores.mean() < 0.15  # and far from solved: room to learn
