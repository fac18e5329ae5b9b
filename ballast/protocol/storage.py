"""Storing Batches, and the plain values around them, in files that cannot run code when read.

`save(directory, value)` writes `value` as two files: `tensors.safetensors` holds every tensor
(safetensors is a header of names, dtypes and shapes followed by raw bytes) and `tree.json` holds the
rest, with each tensor replaced by its name in the safetensors file. `load(directory)` reads them
back. Neither format can name a callable, so a file handed over or rewritten can at worst hold wrong
data, never run code (unlike pickle, whose loader calls whatever the file names).

What can be stored: None, bools, ints, floats, strings, bytes, lists, tuples, dicts (any keys of these
types), numpy arrays of numbers, bools, strings or such objects (a Batch's non-tensors, e.g. chat
messages), numpy scalars, torch tensors and `Batch`es. Anything else is a `StorageError` at save time
naming where it sits; a file that is not what `save` writes is a `StorageError` at load time naming
the file.

JSON carries the structure: a dict whose keys are all strings (none of them `__ballast__`) is a JSON
object; every other kind of value is a JSON object tagged `{"__ballast__": kind, ...}`.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any, Dict

import numpy as np
import torch
from tensordict import TensorDict

from ballast.protocol.batch import Batch

TREE_FILE = "tree.json"
TENSORS_FILE = "tensors.safetensors"
TAG = "__ballast__"
_FORMAT = 1
# numpy dtype kinds stored as JSON numbers/bools/strings: bool, signed, unsigned, float, unicode, bytes.
_PLAIN_KINDS = "biufUS"


class StorageError(ValueError):
    """A value that cannot be stored (at save time) or a file that is not what `save` wrote (at load)."""


def save(directory: str, value: Any) -> None:
    """Write `value` into `directory` (created; its two files replaced)."""
    from safetensors.torch import save_file

    tensors: Dict[str, torch.Tensor] = {}
    tree = {"format": _FORMAT, "value": _encode(value, tensors, "value")}
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, TENSORS_FILE), metadata={"format": "pt"})
    with open(os.path.join(directory, TREE_FILE), "w") as f:
        json.dump(tree, f)


def load(directory: str) -> Any:
    """What `save` wrote into `directory`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tree_file, tensors_file = os.path.join(directory, TREE_FILE), os.path.join(directory, TENSORS_FILE)
    try:
        with open(tree_file) as f:
            tree = json.load(f)
    except (OSError, ValueError) as err:
        raise StorageError(f"{tree_file}: unreadable ({err})") from None
    try:
        tensors = load_file(tensors_file)
    except (OSError, SafetensorError) as err:
        raise StorageError(f"{tensors_file}: unreadable ({err})") from None
    if not isinstance(tree, dict) or tree.get("format") != _FORMAT or "value" not in tree:
        raise StorageError(f"{tree_file}: not a file Ballast wrote (format {_FORMAT} expected)")
    try:
        return _decode(tree["value"], tensors)
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise StorageError(f"{tree_file}: malformed ({type(err).__name__}: {err})") from None


def _encode(value: Any, tensors: Dict[str, torch.Tensor], where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)) and not isinstance(value, np.generic):
        return value
    if isinstance(value, (list, tuple)):
        items = [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {TAG: "tuple", "items": items}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}
        return {TAG: "dict", "items": [[_encode(k, tensors, f"{where} key"), _encode(v, tensors, f"{where}[{k!r}]")]
                                       for k, v in value.items()]}
    if isinstance(value, bytes):
        return {TAG: "bytes", "base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().cpu().contiguous().clone()  # safetensors refuses shared storage
        return {TAG: "tensor", "name": name}
    if isinstance(value, np.ndarray):
        return _encode_array(value, tensors, where)
    if isinstance(value, np.generic) and value.dtype.kind in _PLAIN_KINDS:
        return {TAG: "scalar", "dtype": value.dtype.str, "value": _encode(value.item(), tensors, where)}
    if isinstance(value, Batch):
        return {TAG: "batch", "size": len(value),
                "tensors": {k: _encode(value[k], tensors, f"{where}.{k}") for k in value.tensor_keys},
                "non_tensors": {k: _encode(value[k], tensors, f"{where}.{k}") for k in value.non_tensor_keys},
                "meta": _encode(value.meta, tensors, f"{where}.meta")}
    raise StorageError(f"{where}: cannot store a {type(value).__module__}.{type(value).__qualname__} "
                       "(only plain values, numpy arrays, tensors and Batches are stored)")


def _encode_array(array: np.ndarray, tensors: Dict[str, torch.Tensor], where: str) -> dict:
    kind = array.dtype.kind
    if kind in _PLAIN_KINDS:
        values = [_encode(v, tensors, where) for v in array.ravel().tolist()]
    elif kind == "O":
        values = [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(array.ravel())]
    else:
        raise StorageError(f"{where}: cannot store a numpy array of dtype {array.dtype}")
    return {TAG: "array", "dtype": array.dtype.str, "shape": list(array.shape), "values": values}


def _decode(node: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    kind = node.get(TAG)
    if kind is None:
        return {k: _decode(v, tensors) for k, v in node.items()}
    if kind == "tuple":
        return tuple(_decode(v, tensors) for v in node["items"])
    if kind == "dict":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in node["items"]}
    if kind == "bytes":
        return base64.b64decode(node["base64"])
    if kind == "tensor":
        return tensors[node["name"]]
    if kind == "scalar":
        return np.array(_decode(node["value"], tensors), dtype=np.dtype(node["dtype"]))[()]
    if kind == "array":
        return _decode_array(node, tensors)
    if kind == "batch":
        size = int(node["size"])
        tensor_items = {k: _decode(v, tensors) for k, v in node["tensors"].items()}
        return Batch(TensorDict(tensor_items, batch_size=[size]),
                     {k: _decode(v, tensors) for k, v in node["non_tensors"].items()}, _decode(node["meta"], tensors))
    raise ValueError(f"unknown kind {kind!r}")


def _decode_array(node: dict, tensors: Dict[str, torch.Tensor]) -> np.ndarray:
    dtype, shape = np.dtype(node["dtype"]), tuple(int(n) for n in node["shape"])
    values = [_decode(v, tensors) for v in node["values"]]
    if dtype.kind == "O":
        array = np.empty(len(values), dtype=object)
        for i, v in enumerate(values):
            array[i] = v
        return array.reshape(shape)
    if dtype.kind not in _PLAIN_KINDS:
        raise ValueError(f"dtype {dtype} is not stored")
    return np.array(values, dtype=dtype).reshape(shape)
