"""GSM8K conversion on tiny in-test files (no download), and the example CLIs in examples/data."""

import importlib.util
from pathlib import Path

import pytest

from ballast.data import RLDataset, default_compute_score, read_rows
from ballast.data.gsm8k import convert_gsm8k_file, final_answer, gsm8k_rows
from ballast.data.io import write_jsonl, write_parquet

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "data"
RECORDS = [
    {"question": "Tom has 3 bags of 4 apples. How many apples?", "answer": "3 bags * 4 = <<3*4=12>>12\n#### 12"},
    {"question": "A book costs $1,200 and a pen $5. Total?", "answer": "1200 + 5 = 1205\n#### 1,205"},
]


def _load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_have_verl_format_and_scoreable_ground_truth():
    rows = gsm8k_rows(RECORDS, split="test")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["12", "1205"]
    assert rows[1]["data_source"] == "openai/gsm8k" and rows[1]["extra_info"]["index"] == 1
    assert rows[0]["prompt"][0]["role"] == "user" and RECORDS[0]["question"] in rows[0]["prompt"][0]["content"]
    assert default_compute_score("openai/gsm8k", "so #### 1205", rows[1]["reward_model"]["ground_truth"]) == 1.0


@pytest.mark.parametrize(
    "record, match",
    [
        ({"answer": "#### 1"}, "row 0: field 'question' must be a non-empty string"),
        ({"question": "q", "answer": "no marker"}, "row 0: field 'answer': solution has no '####'"),
        ({"question": "q", "answer": "ok ####  "}, "row 0: field 'answer': solution has nothing after"),
        ({"question": "q"}, "row 0: field 'answer' must be a string"),
    ],
)
def test_bad_records_name_the_row(record, match):
    with pytest.raises(ValueError, match=match):
        gsm8k_rows([record], split="train", source="src.jsonl")
    assert final_answer("x #### 7") == "7"


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_convert_local_file_and_load_it(tmp_path, tokenizer, suffix):
    raw = tmp_path / f"raw{suffix}"
    (write_parquet if suffix == ".parquet" else write_jsonl)(RECORDS, raw)
    out = convert_gsm8k_file(raw, tmp_path / "gsm8k.parquet", split="train")
    ds = RLDataset(out, tokenizer, max_prompt_length=512)
    assert len(ds) == 2 and [s["ground_truth"] for s in ds] == ["12", "1205"]


def test_gsm8k_example_cli(tmp_path, capsys):
    raw = write_jsonl(RECORDS, tmp_path / "test.jsonl")
    assert _load_example("gsm8k").main(["--input", str(raw), "--output", str(tmp_path / "o.jsonl"), "--split", "test"]) == 0
    assert "wrote 2 rows (test)" in capsys.readouterr().out
    assert [r["extra_info"]["split"] for r in read_rows(tmp_path / "o.jsonl")] == ["test", "test"]


def test_make_synthetic_example_cli(tmp_path, capsys):
    args = ["--out", str(tmp_path), "--train-size", "64", "--val-size", "8", "--seed", "4", "--k-max", "100"]
    assert _load_example("make_synthetic").main(args) == 0
    printed = capsys.readouterr().out
    assert '"split": "train"' in printed and '"rows": 64' in printed and '"rows": 8' in printed
    train = read_rows(tmp_path / "train.parquet")
    assert len(train) == 64 and max(r["extra_info"]["count"] for r in train) <= 100
