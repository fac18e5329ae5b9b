"""Batch chunk/split/concat, reorder, repeat and pad/unpad on hand-picked cases and their error messages."""

import numpy as np
import pytest
import torch
from protocol_strategies import make_batch, rows

from ballast.protocol import PAD_COUNT_KEY, Batch


# ------------------------------------------------------------------ chunk / split
def test_chunk_gives_equal_consecutive_views():
    batch = make_batch(6)
    chunks = batch.chunk(3)
    assert [rows(chunk) for chunk in chunks] == [[0, 1], [2, 3], [4, 5]]
    assert all(PAD_COUNT_KEY not in chunk.meta for chunk in chunks)
    assert chunks[1]["logp"].data_ptr() == batch["logp"][2:].data_ptr()


def test_chunk_not_divisible_names_sizes():
    with pytest.raises(ValueError, match=r"cannot chunk 7 samples into 3 equal chunks \(7 % 3 = 1\)"):
        make_batch(7).chunk(3)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2"])
def test_chunk_count_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="num_chunks must be a positive integer"):
        make_batch(4).chunk(bad)


def test_chunk_with_pad_repeats_leading_samples_and_records_count():
    batch = make_batch(5)
    chunks = batch.chunk(4, pad=True)
    assert [rows(chunk) for chunk in chunks] == [[0, 1], [2, 3], [4, 0], [1, 2]]
    assert all(chunk.meta[PAD_COUNT_KEY] == 3 for chunk in chunks)
    restored = Batch.concat(chunks).unpad()
    assert restored.equals(batch)


def test_chunk_pad_more_chunks_than_samples_cycles():
    chunks = make_batch(2).chunk(5, pad=True)
    assert [rows(chunk) for chunk in chunks] == [[0], [1], [0], [1], [0]]
    assert chunks[0].meta[PAD_COUNT_KEY] == 3


def test_split_sizes_and_errors():
    batch = make_batch(7)
    assert [rows(part) for part in batch.split(3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert batch.split(10)[0].equals(batch)
    assert make_batch(0).split(2) == []
    with pytest.raises(ValueError, match="split_size must be a positive integer, got 0"):
        batch.split(0)


# ------------------------------------------------------------------ concat
def test_concat_merges_samples_and_meta():
    parts = make_batch(6).split(2)
    merged = Batch.concat(parts)
    assert rows(merged) == list(range(6))
    assert merged.meta == {"temperature": 1.0}


def test_outputs_concatenate_batches_extend_metrics_and_drop_dispatch_padding():
    from ballast.protocol import Output

    parts = make_batch(6).split(2)
    outputs = [Output(p, {"loss": [float(i)], **({"only_first": [1.0]} if i == 0 else {})}) for i, p in enumerate(parts)]
    merged = Output.concat(outputs, pad_count=1)
    assert rows(merged.batch) == list(range(5))
    assert merged.metrics == {"loss": [0.0, 1.0, 2.0], "only_first": [1.0]}
    assert merged.mean_metrics() == {"loss": 1.0, "only_first": 1.0}
    with pytest.raises(TypeError, match="lists of per-rank values"):
        Output(parts[0], {"loss": 1.0})
    with pytest.raises(TypeError, match="must be a Batch"):
        Output({"x": 1})

def test_concat_of_meta_only_batches_keeps_their_meta():
    merged = Batch.concat([Batch(meta={"a": [1, 2]}), Batch(meta={"a": [1, 2]})])
    assert len(merged) == 0 and merged.meta == {"a": [1, 2]}


def test_concat_accepts_string_arrays_of_different_widths():
    merged = Batch.concat([Batch(non_tensors={"u": np.array(["a"])}), Batch(non_tensors={"u": np.array(["bbb"])})])
    assert list(merged["u"]) == ["a", "bbb"]


def test_concat_errors_name_key_and_batch():
    batch = make_batch(2)
    with pytest.raises(ValueError, match="concat needs at least one Batch"):
        Batch.concat([])
    with pytest.raises(TypeError, match="concat: item 1 is a dict"):
        Batch.concat([batch, {}])
    with pytest.raises(ValueError, match="concat: tensor key 'logp' is in batch 0 but not in batch 1"):
        Batch.concat([batch, batch.select(["row", "tokens", "half", "mask", "tag", "score"])])
    with pytest.raises(ValueError, match="concat: non-tensor key 'extra' is in batch 1 but not in batch 0"):
        other = batch.clone()
        other["extra"] = ["x", "y"]
        Batch.concat([batch, other])
    wide = make_batch(2, trailing=4)
    with pytest.raises(ValueError, match=r"concat: key 'tokens' is int64\[3\] per sample in batch 0 but int64\[4\] in batch 1"):
        Batch.concat([batch, wide])
    double = batch.clone()
    double["logp"] = double["logp"].double()
    with pytest.raises(ValueError, match=r"key 'logp' is float32\[3\] per sample in batch 0 but float64\[3\] in batch 1"):
        Batch.concat([batch, double])


def test_concat_meta_must_agree():
    first, second = make_batch(2), make_batch(2)
    second.meta["temperature"] = 0.5
    with pytest.raises(ValueError, match="meta key 'temperature' disagrees: batch 0 has 1.0, batch 1 has 0.5"):
        Batch.concat([first, second])
    second.meta = {}
    with pytest.raises(ValueError, match="meta key 'temperature' is in batch 0 but not in batch 1"):
        Batch.concat([first, second])


# ------------------------------------------------------------------ reorder
def test_reordered_is_functional_and_reorder_in_place():
    batch = make_batch(4)
    permuted = batch.reordered([2, 0, 3, 1])
    assert rows(permuted) == [2, 0, 3, 1] and rows(batch) == [0, 1, 2, 3]
    batch.reorder(torch.tensor([3, 2, 1, 0]))
    assert rows(batch) == [3, 2, 1, 0]
    assert np.array_equal(batch["score"], np.array([3, 2, 1, 0]) / 2)


@pytest.mark.parametrize(
    "indices, error, message",
    [
        ([0, 1, 2], ValueError, "permutation has 3 entries but the batch has 4 samples"),
        ([0, 1, 1, 3], ValueError, "not a permutation: index 1 appears 2 times and index 2 is missing"),
        ([0, 1, 2, 4], ValueError, r"permutation entry 4 \(at position 3\) is outside \[0, 4\)"),
        ([0, 1, 2, -1], ValueError, r"permutation entry -1 \(at position 3\) is outside"),
        ([[0, 1], [2, 3]], ValueError, "a permutation must be 1-D"),
        ([0.0, 1.0, 2.0, 3.0], TypeError, "a permutation must hold integers"),
    ],
)
def test_reorder_validates_permutation(indices, error, message):
    batch = make_batch(4)
    with pytest.raises(error, match=message):
        batch.reorder(indices)
    assert rows(batch) == [0, 1, 2, 3], "a rejected reorder must leave the batch untouched"


# ------------------------------------------------------------------ repeat
def test_repeat_interleave_and_tile():
    batch = make_batch(3, meta={"step": 4})
    interleaved = batch.repeat(2, interleave=True)
    tiled = batch.repeat(2, interleave=False)
    assert rows(interleaved) == [0, 0, 1, 1, 2, 2] and rows(tiled) == [0, 1, 2, 0, 1, 2]
    assert np.array_equal(interleaved["score"], np.repeat(batch["score"], 2))
    assert torch.equal(tiled["half"], torch.cat([batch["half"], batch["half"]]))
    assert interleaved.meta == {"step": 4} and batch.repeat(1).equals(batch)
    with pytest.raises(ValueError, match="repeat_times must be a positive integer, got 0"):
        batch.repeat(0)


# ------------------------------------------------------------------ pad / unpad
def test_pad_to_divisor_and_unpad():
    batch = make_batch(5)
    padded, pad_count = batch.pad_to_divisor(4)
    assert pad_count == 3 and rows(padded) == [0, 1, 2, 3, 4, 0, 1, 2]
    assert padded.meta[PAD_COUNT_KEY] == 3 and PAD_COUNT_KEY not in batch.meta
    assert padded.unpad().equals(batch)
    assert padded.unpad(pad_count).equals(batch)
    divisible, none_added = batch.pad_to_divisor(5)
    assert none_added == 0 and divisible.meta[PAD_COUNT_KEY] == 0 and divisible.unpad().equals(batch)


def test_padding_twice_accumulates_the_record():
    once, first = make_batch(3).pad_to_divisor(2)
    twice, second = once.pad_to_divisor(3)
    assert (first, second, twice.meta[PAD_COUNT_KEY], len(twice)) == (1, 2, 3, 6)
    partly = twice.unpad(2)
    assert partly.meta[PAD_COUNT_KEY] == 1 and partly.unpad().equals(make_batch(3))


def test_unpad_errors_name_counts():
    batch = make_batch(4)
    with pytest.raises(ValueError, match=r"unpad\(\) without a count needs meta\['pad_count'\]"):
        batch.unpad()
    with pytest.raises(ValueError, match="cannot remove 5 pad samples from a batch of 4"):
        batch.unpad(5)
    with pytest.raises(ValueError, match="pad_count must be a non-negative integer, got -1"):
        batch.unpad(-1)
    padded, _ = make_batch(3).pad_to_divisor(4)
    with pytest.raises(ValueError, match=r"unpad\(2\) removes more than the 1 pad samples recorded"):
        padded.unpad(2)
    assert rows(batch.unpad(1)) == [0, 1, 2]
    with pytest.raises(ValueError, match="divisor must be a positive integer, got 0"):
        batch.pad_to_divisor(0)


# ------------------------------------------------------------------ batches without tensors or samples
def test_non_tensor_only_batch_supports_every_operation():
    batch = Batch(non_tensors={"uid": ["a", "b", "c"]}, meta={"step": 1})
    assert list(batch.repeat(2)["uid"]) == ["a", "a", "b", "b", "c", "c"]
    assert list(batch.repeat(2, interleave=False)["uid"]) == ["a", "b", "c", "a", "b", "c"]
    chunks = batch.chunk(2, pad=True)
    assert [list(chunk["uid"]) for chunk in chunks] == [["a", "b"], ["c", "a"]]
    assert Batch.concat(chunks).unpad().equals(batch)
    assert list(batch.reordered([2, 0, 1])["uid"]) == ["c", "a", "b"]
    assert len(batch.tensors.batch_size) == 1 and len(batch[1:]) == 2


def test_empty_batch_operations():
    empty = make_batch(0)
    assert [len(chunk) for chunk in empty.chunk(3)] == [0, 0, 0]
    padded, pad_count = empty.pad_to_divisor(4)
    assert pad_count == 0 and len(padded) == 0
    assert len(empty.repeat(3)) == 0 and len(Batch.concat([empty, make_batch(2)])) == 2
