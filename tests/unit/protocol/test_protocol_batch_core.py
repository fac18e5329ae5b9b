"""Batch construction, validation, key access, indexing, select/pop/union, conversion and copying."""

import re

import numpy as np
import pytest
import torch
from protocol_strategies import make_batch, rows
from tensordict import TensorDict

from ballast.protocol import Batch


# ------------------------------------------------------------------ construction
def test_construct_from_dict_and_tensordict():
    tensors = {"a": torch.zeros(4, 2), "b": torch.arange(4)}
    from_dict = Batch(tensors, {"uid": np.array(["x", "y", "z", "w"], dtype=object)}, {"k": 1})
    from_td = Batch(TensorDict(tensors, batch_size=[4]), {"uid": ["x", "y", "z", "w"]}, {"k": 1})
    assert len(from_dict) == from_dict.batch_size == 4
    assert from_dict.equals(from_td)
    assert from_td["uid"].dtype == object and from_td["uid"].shape == (4,)
    assert from_dict.tensors.batch_size == torch.Size([4])


def test_tensordict_with_extra_batch_dims_keeps_only_sample_dim():
    td = TensorDict({"a": torch.zeros(3, 5)}, batch_size=[3, 5])
    batch = Batch(td)
    assert batch.tensors.batch_size == torch.Size([3]) and batch["a"].shape == (3, 5)


def test_empty_and_meta_only_batches_have_zero_samples():
    assert len(Batch()) == 0 and Batch().keys() == []
    meta_only = Batch(meta={"step": 1})
    assert len(meta_only) == 0 and meta_only.meta == {"step": 1}


def test_keyless_tensordict_declares_size():
    assert len(Batch(TensorDict({}, batch_size=[7]))) == 7


def test_list_of_lists_stays_one_object_per_sample():
    batch = Batch(non_tensors={"ids": [[1, 2], [3, 4], [5, 6]]})
    assert batch["ids"].shape == (3,) and batch["ids"][1] == [3, 4]


@pytest.mark.parametrize(
    "tensors, non_tensors, message",
    [
        ({"a": torch.zeros(3), "b": torch.zeros(4)}, None, "'b' has 4 samples (first dimension) but 'a' has 3"),
        ({"a": torch.zeros(3)}, {"uid": ["x", "y"]}, "'uid' has 2 samples (first dimension) but 'a' has 3"),
        (TensorDict({"a": torch.zeros(3)}, [3]), {"uid": ["x"]}, "'uid' has 1 samples (first dimension) but the TensorDict batch_size has 3"),
        ({"a": torch.zeros(3)}, {"a": ["x", "y", "z"]}, "'a' is given both as a tensor and as a non-tensor"),
        ({"a": torch.tensor(1.0)}, None, "tensor 'a' is 0-dimensional"),
        (None, {"u": np.array(3)}, "non-tensor 'u' is 0-dimensional"),
    ],
)
def test_inconsistent_construction_names_key_and_sizes(tensors, non_tensors, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Batch(tensors, non_tensors)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tensors": {"a": [1, 2]}}, "tensor 'a' must be a torch.Tensor, got list"),
        ({"non_tensors": {"u": 3}}, "non-tensor 'u' must be a numpy array or a list, got int"),
        ({"tensors": {1: torch.zeros(2)}}, "keys must be str"),
        ({"meta": [1]}, "meta must be a dict"),
        ({"tensors": [torch.zeros(2)]}, "tensors must be a TensorDict or a dict"),
    ],
)
def test_wrong_types_are_type_errors(kwargs, message):
    with pytest.raises(TypeError, match=message):
        Batch(**kwargs)


def test_nested_tensordict_is_rejected_with_key():
    td = TensorDict({"outer": TensorDict({"x": torch.zeros(2)}, [2])}, [2])
    with pytest.raises(ValueError, match="nested TensorDict under 'outer'"):
        Batch(td)


# ------------------------------------------------------------------ key access
def test_keys_contains_getitem_setitem_delitem():
    batch = make_batch(4)
    assert batch.tensor_keys == ["row", "tokens", "logp", "half", "mask"]
    assert batch.non_tensor_keys == ["tag", "score"]
    assert batch.keys() == batch.tensor_keys + batch.non_tensor_keys
    assert "tokens" in batch and "tag" in batch and "nope" not in batch and 3 not in batch
    assert torch.equal(batch["row"], torch.arange(4))
    assert list(batch["tag"]) == ["s0", "s1", "s2", "s3"]
    batch["new"] = torch.ones(4, 2)
    batch["names"] = ["a", "b", "c", "d"]
    assert batch["new"].shape == (4, 2) and batch["names"][2] == "c"
    batch["tag"] = torch.zeros(4)  # replacing a key may change its kind
    assert "tag" in batch.tensor_keys and "tag" not in batch.non_tensor_keys
    del batch["new"]
    assert "new" not in batch
    with pytest.raises(KeyError, match="no key 'nope'"):
        batch["nope"]
    with pytest.raises(KeyError, match="no key 'nope'"):
        del batch["nope"]


def test_setitem_validates_first_dim():
    batch = make_batch(4)
    with pytest.raises(ValueError, match="key 'x' has 3 samples .* but the batch has 4"):
        batch["x"] = torch.zeros(3)
    with pytest.raises(ValueError, match="key 'y' has 5 samples .* but the batch has 4"):
        batch["y"] = np.zeros(5)
    assert "x" not in batch and "y" not in batch


def test_setitem_on_keyless_batch_adopts_size():
    batch = Batch(meta={"step": 1})
    batch["uid"] = ["a", "b", "c"]
    batch["x"] = torch.zeros(3)
    assert len(batch) == 3


def test_batch_is_not_iterable():
    with pytest.raises(TypeError, match="not iterable"):
        iter(make_batch(2))


# ------------------------------------------------------------------ indexing
@pytest.mark.parametrize(
    "index, expected",
    [
        (2, [2]),
        (-1, [5]),
        (slice(1, 4), [1, 2, 3]),
        (slice(None, None, 2), [0, 2, 4]),
        (slice(None, None, -2), [5, 3, 1]),
        ([4, 0, 0], [4, 0, 0]),
        (np.array([3, -6]), [3, 0]),
        (torch.tensor([5, 1]), [5, 1]),
        (np.array([True, False, True, False, False, True]), [0, 2, 5]),
        (torch.tensor([False] * 6), []),
        ([], []),
        (np.int64(1), [1]),
        (torch.tensor(3), [3]),
    ],
)
def test_indexing_returns_batch_with_selected_rows(index, expected):
    batch = make_batch(6)
    result = batch[index]
    assert isinstance(result, Batch)
    assert rows(result) == expected
    assert result["half"].dtype == torch.bfloat16 and result["half"].shape == (len(expected), 3)
    assert np.array_equal(result["score"], np.array(expected, dtype=np.float64) / 2)
    assert result.meta == batch.meta and result.meta is not batch.meta


@pytest.mark.parametrize(
    "index, error, message",
    [
        (6, IndexError, "sample index 6 is out of range for 6 samples"),
        (-7, IndexError, "sample index -7 is out of range for 6 samples"),
        ([0, 9], IndexError, r"sample index 9 \(at position 1\) is out of range for 6 samples"),
        (np.array([True, False]), ValueError, "boolean mask has 2 entries but the batch has 6 samples"),
        (np.zeros((2, 2), dtype=int), ValueError, "must be 1-D"),
        (np.array([0.5]), TypeError, "must hold integers or bools"),
        (True, TypeError, "cannot index a Batch with a bool"),
        ((0, 1), TypeError, "cannot index a Batch with tuple"),
    ],
)
def test_bad_indices_name_the_index_and_size(index, error, message):
    with pytest.raises(error, match=message):
        make_batch(6)[index]


def test_slices_are_views_and_index_arrays_copy():
    batch = make_batch(4)
    view, copied = batch[1:3], batch[[1, 2]]
    view["logp"][0, 0] = 123.0
    copied["logp"][1, 0] = -5.0
    assert batch["logp"][1, 0] == 123.0 and batch["logp"][2, 0] != -5.0


# ------------------------------------------------------------------ select / pop / union
def test_select_mixed_keys_shares_data():
    batch = make_batch(3)
    chosen = batch.select(["tokens", "tag"])
    assert chosen.keys() == ["tokens", "tag"] and chosen.meta == batch.meta
    assert chosen["tokens"].data_ptr() == batch["tokens"].data_ptr()
    assert batch.select("row").keys() == ["row"]
    with pytest.raises(KeyError, match="no key 'missing'"):
        batch.select(["row", "missing"])


def test_pop_removes_in_place_and_returns_popped():
    batch = make_batch(3)
    before = batch.clone()
    popped = batch.pop(["logp", "score"])
    assert popped.keys() == ["logp", "score"] and len(popped) == 3
    assert "logp" not in batch and "score" not in batch
    assert popped.union(batch).equals(before)
    with pytest.raises(KeyError, match="no key 'logp'"):
        batch.pop("logp")


def test_union_merges_fields_and_meta():
    left = make_batch(4).select(["row", "tokens", "tag"])
    left.meta = {"step": 3}
    right = make_batch(4).select(["row", "logp", "score"])
    right.meta = {"temperature": 0.7, "step": 3}
    merged = left.union(right)
    assert merged.keys() == ["row", "tokens", "logp", "tag", "score"]
    assert merged.meta == {"step": 3, "temperature": 0.7}
    assert "logp" not in left and left.meta == {"step": 3}


def test_union_with_meta_only_batch_adds_its_meta():
    batch = make_batch(3)
    merged = batch.union(Batch(meta={"step": 4}))
    assert len(merged) == 3 and merged.meta == {"temperature": 1.0, "step": 4}


def test_union_errors_name_key_or_sizes():
    batch = make_batch(4)
    other = make_batch(4, seed=1)
    with pytest.raises(ValueError, match=r"union: key 'tokens' differs .*int64\[4, 3\]"):
        batch.union(other.select(["tokens"]))
    with pytest.raises(ValueError, match="cannot union batches of 4 and 5 samples"):
        batch.union(make_batch(5))
    clash = batch.select(["row"])
    clash.meta["temperature"] = 0.5
    with pytest.raises(ValueError, match="meta key 'temperature' disagrees: operand 0 has 1.0, operand 1 has 0.5"):
        batch.union(clash)
    tensor_vs_array = Batch({"tag": torch.zeros(4)})
    with pytest.raises(ValueError, match="union: key 'tag' differs"):
        batch.union(tensor_vs_array)
    with pytest.raises(TypeError, match="union needs a Batch"):
        batch.union({"a": 1})


def test_union_treats_nan_as_equal():
    values = torch.tensor([float("nan"), 1.0])
    assert len(Batch({"v": values}).union(Batch({"v": values.clone()}))) == 2


# ------------------------------------------------------------------ conversion / copies
def test_to_dict_from_dict_round_trip():
    batch = make_batch(5, meta={"step": 2, "names": {"x": [1.0]}})
    as_dict = batch.to_dict()
    assert set(as_dict) == {"tensors", "non_tensors", "meta"}
    assert set(as_dict["tensors"]) == set(batch.tensor_keys)
    assert Batch.from_dict(as_dict).equals(batch)


def test_from_flat_dict_sorts_tensors_from_arrays():
    batch = Batch.from_dict({"x": torch.zeros(2, 3), "uid": ["a", "b"], "score": np.ones(2)}, meta={"k": 1})
    assert batch.tensor_keys == ["x"] and batch.non_tensor_keys == ["uid", "score"] and batch.meta == {"k": 1}
    with pytest.raises(ValueError, match="either inside the dict or as an argument"):
        Batch.from_dict(make_batch(2).to_dict(), meta={"k": 1})


def test_clone_is_deep_and_to_moves_tensors():
    batch = make_batch(3, meta={"nested": {"a": [1]}})
    batch["payload"] = [{"ids": [1]}, {"ids": [2]}, {"ids": [3]}]
    twin = batch.clone()
    assert twin.equals(batch)
    twin["logp"][0, 0] = 99.0
    twin["payload"][0]["ids"].append(7)
    twin.meta["nested"]["a"].append(2)
    assert batch["logp"][0, 0] != 99.0 and batch["payload"][0]["ids"] == [1] and batch.meta["nested"]["a"] == [1]
    moved = batch.to("cpu")
    assert moved.equals(batch) and moved["logp"].device == torch.device("cpu")


def test_equals_detects_differences():
    batch = make_batch(3)
    assert batch.equals(make_batch(3)) and not batch.equals(make_batch(3, seed=5))
    other = make_batch(3)
    other.meta["temperature"] = 2.0
    assert not batch.equals(other) and not batch.equals(batch[:2]) and not batch.equals("batch")


def test_repr_lists_fields_shapes_and_meta_keys():
    text = repr(make_batch(2, meta={"step": 1}))
    assert text.startswith("Batch(num_samples=2,")
    assert "half: bfloat16[2, 3] cpu" in text and "tag: object[2]" in text and "meta_keys=['step']" in text
