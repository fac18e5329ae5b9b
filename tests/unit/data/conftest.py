"""Fixtures for the data tests: the cached tiny tokenizer and small verl-format files."""

import pytest

from ballast.data.io import write_jsonl, write_parquet
from ballast.models import load_tokenizer, tiny_model_dir
from data_rows import make_row


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(tiny_model_dir("tiny"))


@pytest.fixture
def mixed_files(tmp_path):
    """A parquet file with 3 short prompts and a JSONL file with 1 short and 2 long prompts."""
    short = [make_row(f"Repeat the symbol # exactly {k} times.", index=k) for k in (1, 2, 3)]
    long_text = " ".join(["apples and pears"] * 20)
    jsonl = [make_row("Say hi.", index=10)] + [make_row(long_text + f" {i}", index=11 + i) for i in range(2)]
    return write_parquet(short, tmp_path / "a.parquet"), write_jsonl(jsonl, tmp_path / "b.jsonl")
