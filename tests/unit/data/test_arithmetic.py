"""The arithmetic task: deterministic verl-format rows with correct answers, a held-out val split,
and the exact-answer reward (last integer of the response)."""

import pytest

from ballast.data import default_compute_score, make_arithmetic_rows, read_rows, write_arithmetic_dataset
from ballast.data.arithmetic import DATA_SOURCE, KINDS, arithmetic_score, last_integer


def test_rows_are_verl_format_and_answers_are_right():
    rows = make_arithmetic_rows(200, seed=3, kinds=KINDS, lo=10, hi=99)
    assert {r["extra_info"]["kind"] for r in rows} == set(KINDS)
    for r in rows:
        assert r["data_source"] == DATA_SOURCE and r["reward_model"]["style"] == "rule"
        (msg,) = r["prompt"]
        assert msg["role"] == "user" and msg["content"].endswith("Give only the final number.")
        ops, kind, truth = r["extra_info"]["operands"], r["extra_info"]["kind"], int(r["reward_model"]["ground_truth"])
        expected = {"add": lambda: ops[0] + ops[1], "sub": lambda: ops[0] - ops[1], "mul": lambda: ops[0] * ops[1],
                    "add3": lambda: sum(ops)}[kind]()
        assert truth == expected and truth >= 0
        # the question states exactly the operands it is scored on
        assert all(str(x) in msg["content"] for x in ops)


def test_rows_are_deterministic_per_seed_and_split():
    assert make_arithmetic_rows(20, seed=1) == make_arithmetic_rows(20, seed=1)
    assert make_arithmetic_rows(20, seed=1) != make_arithmetic_rows(20, seed=2)
    assert make_arithmetic_rows(20, seed=1, split="val") != make_arithmetic_rows(20, seed=1)


def test_val_split_is_held_out(tmp_path):
    paths = write_arithmetic_dataset(tmp_path, train_size=500, val_size=40, seed=0)
    train, val = read_rows(paths["train"]), read_rows(paths["val"])
    assert len(train) == 500 and len(val) == 40
    assert not {r["prompt"][0]["content"] for r in val} & {r["prompt"][0]["content"] for r in train}
    assert [r["extra_info"]["index"] for r in val] == list(range(40))


@pytest.mark.parametrize("kwargs, match", [
    (dict(kinds=("div",)), "kinds must be a non-empty subset"),
    (dict(kinds=()), "kinds must be a non-empty subset"),
    (dict(lo=50, hi=10), "need 0 <= lo <= hi"),
    (dict(b_lo=5, b_hi=1), "0 <= b_lo <= b_hi"),
])
def test_bad_task_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_arithmetic_rows(4, **kwargs)


def test_held_out_split_too_small_for_a_narrow_range_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="held-out questions"):
        write_arithmetic_dataset(tmp_path, train_size=400, val_size=50, lo=1, hi=5)


@pytest.mark.parametrize("response, score, answered", [
    ("85", 1.0, 1.0),
    ("47 + 38 = 85", 1.0, 1.0),           # the last integer is the answer
    ("The answer is 85.", 1.0, 1.0),
    ("85 is wrong, it is 84", 0.0, 1.0),
    ("1,085", 0.0, 1.0),                   # thousands separator: 1085, not 85
    ("eighty-five", 0.0, 0.0),
    ("", 0.0, 0.0),
])
def test_reward_scores_the_last_integer(response, score, answered):
    out = default_compute_score(DATA_SOURCE, response, "85")
    assert out == {"score": score, "answered": answered}


def test_reward_rejects_a_non_integer_ground_truth():
    with pytest.raises(ValueError, match="must be an integer"):
        arithmetic_score(DATA_SOURCE, "3", "three")
    assert last_integer("x -12 y") == -12


def _plot_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "plot_val_curve.py"
    spec = importlib.util.spec_from_file_location("example_plot_val_curve", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_curve_script_reads_validation_points_and_writes_the_png(tmp_path, capsys):
    import json

    run = tmp_path / "seed7"
    run.mkdir()
    rows = [{"step": 0, "val/score/mean": 0.25}, {"step": 1, "timing_s/step": 40.0},
            {"step": 2, "timing_s/step": 50.0, "val/score/mean": 0.5}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    plot = _plot_module()
    assert plot.main(["--out", str(tmp_path / "c.png"), str(run / "metrics.jsonl")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary == {"run": "seed7", "first_step": 0, "first": 0.25, "last_step": 2, "last": 0.5, "gain": 0.25,
                       "best": 0.5, "train_wall_s_to_last_val": 90.0}
    assert (tmp_path / "c.png").stat().st_size > 1000
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "timing_s/step": 1.0}) + "\n")
    with pytest.raises(ValueError, match="no 'val/score/mean' entries"):
        plot.load_run(run / "metrics.jsonl")
