"""RLDataset: parquet + JSONL loading, chat template + tokenization, the four truncation modes with
counts, errors naming file/row/field, the tokenizer consistency check, and the left-pad collator."""

import json

import numpy as np
import pytest
import torch

from ballast.data import PromptCollator, RLDataset, check_tokenization
from ballast.data.io import write_jsonl, write_parquet

from data_rows import make_row


def _prompt_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_loads_parquet_and_jsonl_with_fields(tokenizer, mixed_files):
    ds = RLDataset(list(mixed_files), tokenizer, max_prompt_length=512)
    assert len(ds) == 6 and ds.stats.num_rows_read == 6
    first = ds[0]
    assert first["input_ids"].dtype == torch.long and first["input_ids"].dim() == 1
    assert first["input_ids"].tolist() == _prompt_ids(tokenizer, first["raw_prompt"])
    assert first["input_ids"][-3:].tolist() == tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert first["data_source"] == "ballast/repeat"
    assert first["ground_truth"] == "##" and first["reward_model"]["style"] == "rule"
    assert first["extra_info"]["split"] == "train" and first["index"] == 1
    assert ds[3]["index"] == 10  # JSONL rows follow the parquet rows, in file order


def _long_short_lengths(tokenizer, mixed_files):
    full = RLDataset(list(mixed_files), tokenizer, max_prompt_length=4096)
    lengths = [len(s["input_ids"]) for s in full]
    return sorted(lengths)[3], max(lengths)  # longest short prompt, longest prompt


def test_filter_drops_and_counts_long_prompts(tokenizer, mixed_files, caplog):
    limit, _ = _long_short_lengths(tokenizer, mixed_files)
    with caplog.at_level("INFO"):
        ds = RLDataset(list(mixed_files), tokenizer, max_prompt_length=limit, truncation="filter")
    assert len(ds) == 4 and ds.stats.num_filtered == 2 and ds.stats.num_truncated == 0
    assert all(len(s["input_ids"]) <= limit for s in ds)
    assert "dropped 2 of 6 prompts longer than max_prompt_length" in caplog.text


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_keeps_the_right_end(tokenizer, mixed_files, side):
    limit, _ = _long_short_lengths(tokenizer, mixed_files)
    full = RLDataset(list(mixed_files), tokenizer, max_prompt_length=4096)
    ds = RLDataset(list(mixed_files), tokenizer, max_prompt_length=limit, truncation=side)
    assert len(ds) == 6 and ds.stats.num_truncated == 2 and ds.stats.num_filtered == 0
    for original, cut in zip(full, ds):
        ids, kept = original["input_ids"], cut["input_ids"]
        if len(ids) <= limit:
            assert torch.equal(ids, kept)
        else:
            assert len(kept) == limit
            assert torch.equal(kept, ids[-limit:] if side == "left" else ids[:limit])


@pytest.mark.parametrize("side", ["left", "right", "filter"])
def test_right_truncation_warns_that_it_cut_the_generation_prompt(tokenizer, mixed_files, caplog, side):
    limit, _ = _long_short_lengths(tokenizer, mixed_files)
    with caplog.at_level("WARNING"):
        RLDataset(list(mixed_files), tokenizer, max_prompt_length=limit, truncation=side)
    warned = [r.getMessage() for r in caplog.records if "generation prompt" in r.getMessage()]
    if side != "right":  # left truncation keeps the end of the prompt, where the assistant turn begins
        assert warned == []
        return
    assert len(warned) == 1, caplog.text
    assert ("truncation='right' cut the end of 2 prompt(s) longer than max_prompt_length=" in warned[0]
            and "'<|im_start|>assistant\\n'" in warned[0] and "truncation='left' or 'filter'" in warned[0]), warned


def test_error_mode_names_file_row_and_lengths(tokenizer, mixed_files):
    limit, longest = _long_short_lengths(tokenizer, mixed_files)
    with pytest.raises(ValueError, match=rf"b\.jsonl' row 1: prompt has \d+ tokens > max_prompt_length={limit}"):
        RLDataset(list(mixed_files), tokenizer, max_prompt_length=limit, truncation="error")


def test_string_prompt_is_one_user_message(tokenizer, tmp_path):
    row = make_row("x")
    row["prompt"] = "Say hi."
    ds = RLDataset(write_jsonl([row], tmp_path / "s.jsonl"), tokenizer)
    assert ds[0]["raw_prompt"] == [{"role": "user", "content": "Say hi."}]


BAD_ROWS = [
    ("prompt", None, "field 'prompt' is missing"),
    ("prompt", "   ", "field 'prompt' is an empty string"),
    ("prompt", [], "field 'prompt' must be a non-empty list"),
    ("prompt", [{"role": "user", "content": 5}], r"field 'prompt\[0\].content' must be a string"),
    ("prompt", [{"content": "hi"}], r"field 'prompt\[0\].role' must be a non-empty string"),
    ("prompt", [{"role": "user", "content": ""}], "field 'prompt' has only empty message contents"),
    ("data_source", None, "field 'data_source' must be a non-empty string"),
    ("reward_model", {"style": "rule"}, "field 'reward_model.ground_truth' is missing"),
    ("reward_model", None, "field 'reward_model.ground_truth' is missing"),
    ("extra_info", [1, 2], "field 'extra_info' must be a dict"),
]


@pytest.mark.parametrize("field, value, match", BAD_ROWS)
def test_bad_rows_name_file_row_and_field(tokenizer, tmp_path, field, value, match):
    rows = [make_row("Say hi.", index=i) for i in range(3)]
    if value is None:
        del rows[2][field]
    else:
        rows[2][field] = value
    path = write_jsonl(rows, tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match=rf"bad\.jsonl' row 2: {match}"):
        RLDataset(path, tokenizer)


def test_file_errors_name_the_file(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        RLDataset(tmp_path / "missing.parquet", tokenizer)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError, match="corrupt.parquet.*not a readable parquet"):
        RLDataset(corrupt, tokenizer)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(make_row("hi")) + "\n{not json\n")
    with pytest.raises(ValueError, match="broken.jsonl' line 2: invalid JSON"):
        RLDataset(broken, tokenizer)
    other = tmp_path / "rows.csv"
    other.write_text("a,b\n")
    with pytest.raises(ValueError, match="rows.csv.*unsupported data file type"):
        RLDataset(other, tokenizer)
    with pytest.raises(ValueError, match="truncation must be one of"):
        RLDataset(tmp_path / "x.jsonl", tokenizer, truncation="center")


class _MismatchedTokenizer:
    """Wraps the real tokenizer but drops one attention-mask entry for the prompt containing 'BAD'."""

    def __init__(self, inner):
        self.inner = inner
        self.chat_template = inner.chat_template

    def apply_chat_template(self, *args, **kwargs):
        return self.inner.apply_chat_template(*args, **kwargs)

    def __len__(self):
        return len(self.inner)

    def __call__(self, texts, **kwargs):
        out = self.inner(texts, **kwargs)
        masks = [m[:-1] if "BAD" in t else m for t, m in zip(texts, out["attention_mask"])]
        return {"input_ids": out["input_ids"], "attention_mask": masks}


def test_tokenizer_consistency_check_names_the_row(tokenizer, tmp_path):
    rows = [make_row("fine"), make_row("fine too"), make_row("BAD one")]
    path = write_parquet(rows, tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"t\.parquet' row 2: tokenizer returned \d+ input_ids but \d+ attention_mask"):
        RLDataset(path, _MismatchedTokenizer(tokenizer))
    with pytest.raises(ValueError, match="here: token ids \\[9999\\] are outside"):
        check_tokenization([1, 9999], [1, 1], where="here", vocab_size=512)
    with pytest.raises(ValueError, match="here: attention_mask of an unpadded prompt has zeros"):
        check_tokenization([1, 2], [1, 0], where="here")


def test_collator_left_pads_with_positions_and_object_arrays(tokenizer, mixed_files):
    ds = RLDataset(list(mixed_files), tokenizer, max_prompt_length=512)
    samples = [ds[0], ds[4], ds[3]]
    lengths = [len(s["input_ids"]) for s in samples]
    batch = PromptCollator(tokenizer.pad_token_id)(samples)
    width = max(lengths)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["position_ids"].shape == (3, width)
    for row, (sample, length) in enumerate(zip(samples, lengths)):
        assert torch.equal(batch["input_ids"][row, width - length :], sample["input_ids"])
        assert (batch["input_ids"][row, : width - length] == tokenizer.pad_token_id).all()
        assert batch["attention_mask"][row].sum() == length
        assert batch["attention_mask"][row, width - length :].all()
        assert batch["position_ids"][row, width - length :].tolist() == list(range(length))
        assert (batch["position_ids"][row, : width - length] == 0).all()
    for key in ("data_source", "reward_model", "ground_truth", "extra_info", "index", "raw_prompt"):
        assert batch[key].dtype == object and batch[key].shape == (3,), key
    assert batch["raw_prompt"][0] == samples[0]["raw_prompt"]
    assert list(batch["index"]) == [s["index"] for s in samples]
    fixed = PromptCollator(tokenizer.pad_token_id, pad_to_length=width + 5)(samples)
    assert fixed["input_ids"].shape == (3, width + 5)
    assert torch.equal(fixed["input_ids"][:, 5:], batch["input_ids"])
    with pytest.raises(ValueError, match=f"a prompt has {width} tokens > pad_to_length=2"):
        PromptCollator(tokenizer.pad_token_id, pad_to_length=2)(samples)


def test_raw_prompt_column_is_never_two_dimensional(tokenizer, tmp_path):
    rows = [make_row("one", index=0), make_row("two", index=1)]  # equal-length message lists
    ds = RLDataset(write_parquet(rows, tmp_path / "p.parquet"), tokenizer)
    batch = PromptCollator(tokenizer.pad_token_id)([ds[0], ds[1]])
    assert batch["raw_prompt"].shape == (2,)
    assert isinstance(batch["raw_prompt"][1], list) and isinstance(np.asarray(batch["index"]), np.ndarray)


def test_middle_truncation_keeps_both_ends_as_verl(tokenizer, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(make_row(" ".join(str(i) for i in range(40)))) + "\n")
    full = RLDataset(path, tokenizer, max_prompt_length=10_000)[0]["input_ids"].tolist()
    for keep in (7, 8):
        ids = RLDataset(path, tokenizer, max_prompt_length=keep, truncation="middle")[0]["input_ids"].tolist()
        assert ids == full[: keep // 2] + full[len(full) - (keep - keep // 2):]
