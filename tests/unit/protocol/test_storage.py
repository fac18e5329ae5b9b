"""Batches and the values around them round-trip through files that cannot run code (JSON and
safetensors), with every kind a rollout carries; what cannot be stored is refused at save time naming
where it sits, and a rewritten file is refused at load time naming the file."""

import json
import math
import os

import numpy as np
import pytest
import torch

from ballast.protocol import Batch, storage
from ballast.protocol._checks import values_equal


def _objects(*items):
    array = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        array[i] = item
    return array


def _batch():
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "tool_calls": None}]
    return Batch(
        {"input_ids": torch.arange(6).reshape(2, 3), "mask": torch.tensor([[True, False], [True, True]]),
         "logp": torch.randn(2, 4, dtype=torch.bfloat16), "view": torch.arange(10.0)[::5]},  # a strided view
        {"uid": np.array(["a-0", "a-1"], dtype=object), "raw_prompt": _objects(messages, messages[:1]),
         "extra_info": _objects({"index": 3, "tags": ("x", 1), "nested": np.array([1.5, 2.5])}, {}),
         "score": np.array([0.5, float("nan")]), "grid": np.arange(4, dtype=np.int32).reshape(2, 2),
         "names": np.array(["short", "longer"]), "blob": _objects(b"\x00\xff", None)},
        {"temperature": 0.7, "metrics": {"gen/seconds": [np.float32(1.25)]}, "step": np.int64(4),
         "pairs": {(1, 2): "tuple key"}, "__ballast__": "a key that is the tag"},
    )


def test_a_batch_and_plain_values_round_trip(tmp_path):
    value = [{"step": 3, "batch": _batch(), "timing": {"gen": 1.5}, "versions": np.array([2, 2], dtype=np.int64),
              "none": None, "flag": np.bool_(True), "inf": math.inf}]
    storage.save(str(tmp_path / "ahead"), value)
    assert sorted(os.listdir(tmp_path / "ahead")) == [storage.TENSORS_FILE, storage.TREE_FILE]
    (back,) = storage.load(str(tmp_path / "ahead"))
    assert back["batch"].equals(value[0]["batch"])
    assert back["batch"]["logp"].dtype == torch.bfloat16 and back["batch"]["grid"].dtype == np.int32
    extra = back["batch"]["extra_info"][0]
    assert extra["tags"] == ("x", 1) and isinstance(extra["nested"], np.ndarray)
    assert back["batch"].meta["pairs"] == {(1, 2): "tuple key"} and type(back["batch"].meta["step"]) is np.int64
    assert values_equal(back["versions"], value[0]["versions"]) and back["versions"].dtype == np.int64
    assert back["flag"] is np.True_ and back["inf"] == math.inf and back["none"] is None and back["step"] == 3


def test_what_cannot_be_stored_is_refused_naming_where_it_sits(tmp_path):
    batch = Batch({"x": torch.zeros(2)}, {"obj": _objects(object(), 1)})
    with pytest.raises(storage.StorageError, match=r"value\[0\]\['batch'\]\.obj\[0\]: cannot store a builtins\.object"):
        storage.save(str(tmp_path / "bad"), [{"batch": batch}])


def test_a_rewritten_file_is_refused_naming_it(tmp_path):
    directory = str(tmp_path / "ahead")
    storage.save(directory, {"batch": _batch()})
    tree_file = os.path.join(directory, storage.TREE_FILE)
    tree = json.load(open(tree_file))
    tree["value"]["batch"] = {storage.TAG: "pickle", "data": "gASVIAAAAAAAAACMCGJ1aWx0aW5zlIwEZXhlY5STlC4="}
    json.dump(tree, open(tree_file, "w"))
    with pytest.raises(storage.StorageError, match=rf"{tree_file}: malformed .*unknown kind 'pickle'"):
        storage.load(directory)
    open(os.path.join(directory, storage.TENSORS_FILE), "wb").write(b"\x80\x04not safetensors")
    with pytest.raises(storage.StorageError, match=r"tensors\.safetensors: unreadable"):
        storage.load(directory)
