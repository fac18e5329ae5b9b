"""Input validation and value comparison shared by `Batch` operations.

Kept apart from `batch.py` so the container itself reads as a list of operations; every function
here raises a `ValueError`/`TypeError`/`IndexError` whose message names the offending key, index or
size, because these errors surface far from where the bad batch was built (often in a Ray worker).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

"""Meta key holding a `dict[str, list]` of per-step observations; `concat` and `union` extend the lists."""


def short_repr(value: Any, limit: int = 80) -> str:
    """`repr` cut to `limit` characters, so an error message quoting a meta value stays one line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def dtype_name(dtype: torch.dtype | np.dtype) -> str:
    """'int64', 'bfloat16', 'object': torch and numpy dtypes named alike in messages."""
    return str(dtype).removeprefix("torch.")


def describe_value(value: Any) -> str:
    """'tensor int64[4, 3]' / 'array object[4]': enough to tell two same-named fields apart."""
    kind = "tensor" if isinstance(value, torch.Tensor) else "array"
    return f"{kind} {dtype_name(value.dtype)}{list(value.shape)}"


def as_non_tensor_array(key: str, value: Any) -> np.ndarray:
    """Validate a non-tensor entry; a list/tuple becomes a 1-D object array (one element per sample).

    Lists are converted element by element on purpose: `np.array(list_of_equal_length_lists)` would
    silently build a 2-D array and change what "one sample" means.
    """
    if isinstance(value, (list, tuple)):
        array = np.empty(len(value), dtype=object)
        for position, item in enumerate(value):
            array[position] = item
        return array
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"non-tensor {key!r} must be a numpy array or a list, got {type(value).__name__}"
        )
    if value.ndim == 0:
        raise ValueError(f"non-tensor {key!r} is 0-dimensional; it needs a first (sample) dimension")
    return value


def check_tensor(key: str, value: Any) -> torch.Tensor:
    """Validate a tensor entry: a `torch.Tensor` with a first (sample) dimension."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"tensor {key!r} must be a torch.Tensor, got {type(value).__name__} "
            "(put per-sample Python objects in non_tensors)"
        )
    if value.dim() == 0:
        raise ValueError(f"tensor {key!r} is 0-dimensional; it needs a first (sample) dimension")
    return value


def check_key(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"Batch keys must be str, got {key!r} ({type(key).__name__})")
    return key


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def normalize_index(index: Any, num_samples: int) -> slice | np.ndarray:
    """Turn an int / slice / int array / bool mask into a forward slice or a 1-D int64 array.

    Ints become length-1 slices so that indexing never drops the sample dimension. Negative slice
    steps become arrays because torch (and hence TensorDict) does not support them.
    """
    if isinstance(index, (bool, np.bool_)):
        raise TypeError(f"cannot index a Batch with a bool ({index!r}); use a boolean mask array")
    if isinstance(index, numbers.Integral):
        position = int(index)
        if not -num_samples <= position < num_samples:
            raise IndexError(f"sample index {position} is out of range for {num_samples} samples")
        position %= num_samples
        return slice(position, position + 1)
    if isinstance(index, slice):
        if index.step is not None and index.step < 0:
            return np.ascontiguousarray(np.arange(num_samples)[index])
        return index
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    elif isinstance(index, list):
        index = np.asarray(index) if index else np.zeros(0, dtype=np.int64)
    if not isinstance(index, np.ndarray):
        raise TypeError(
            f"cannot index a Batch with {type(index).__name__}; use a str key, an int, a slice, "
            "an integer index array/list or a boolean mask"
        )
    if index.ndim == 0:
        return normalize_index(index.item(), num_samples)
    if index.ndim != 1:
        raise ValueError(f"a sample index array must be 1-D, got shape {tuple(index.shape)}")
    if index.dtype == np.bool_:
        if len(index) != num_samples:
            raise ValueError(
                f"boolean mask has {len(index)} entries but the batch has {num_samples} samples"
            )
        return np.flatnonzero(index)
    if not np.issubdtype(index.dtype, np.integer):
        raise TypeError(f"a sample index array must hold integers or bools, got dtype {index.dtype}")
    bad = (index < -num_samples) | (index >= num_samples)
    if bad.any():
        position = int(np.flatnonzero(bad)[0])
        raise IndexError(
            f"sample index {int(index[position])} (at position {position}) is out of range "
            f"for {num_samples} samples"
        )
    return np.where(index < 0, index + num_samples, index).astype(np.int64, copy=False)


def check_permutation(indices: Any, num_samples: int) -> np.ndarray:
    """Return `indices` as an int64 array after checking it is a permutation of range(num_samples)."""
    if isinstance(indices, torch.Tensor):
        indices = indices.detach().cpu().numpy()
    array = np.asarray(indices)
    if array.size == 0:
        array = array.astype(np.int64)
    if array.ndim != 1:
        raise ValueError(f"a permutation must be 1-D, got shape {tuple(array.shape)}")
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"a permutation must hold integers, got dtype {array.dtype}")
    if len(array) != num_samples:
        raise ValueError(
            f"permutation has {len(array)} entries but the batch has {num_samples} samples"
        )
    bad = (array < 0) | (array >= num_samples)
    if bad.any():
        position = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"permutation entry {int(array[position])} (at position {position}) is outside "
            f"[0, {num_samples})"
        )
    counts = np.bincount(array, minlength=num_samples)
    if (counts != 1).any():
        repeated = int(np.flatnonzero(counts > 1)[0])
        missing = int(np.flatnonzero(counts == 0)[0])
        raise ValueError(
            f"not a permutation: index {repeated} appears {int(counts[repeated])} times "
            f"and index {missing} is missing"
        )
    return array.astype(np.int64, copy=False)


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and values; NaN equals NaN (a key carried through two paths stays equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == object:
        return all(values_equal(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1)))
    if np.issubdtype(a.dtype, np.inexact):
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


def values_equal(a: Any, b: Any) -> bool:
    """Structural equality for tensors, arrays, mappings, sequences and scalars (NaN == NaN)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and arrays_equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(values_equal, a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def merge_meta(metas: list[dict], what: str, same_keys: bool) -> dict:
    """Merge the meta dicts of several batches.

    A key present in several dicts must hold equal values. With `same_keys` (concat: the batches are
    parts of one batch) every dict must also have the same keys; without it (union) keys are pooled.
    `what` ("batch" or "operand") only words the error message.
    """
    merged: dict = {}
    holders: dict = {}
    for position, meta in enumerate(metas):
        for key, value in meta.items():
            if key not in merged:
                merged[key], holders[key] = value, position
            elif not values_equal(merged[key], value):
                raise ValueError(
                    f"meta key {key!r} disagrees: {what} {holders[key]} has {short_repr(merged[key])}, "
                    f"{what} {position} has {short_repr(value)}"
                )
    if same_keys:
        for position, meta in enumerate(metas):
            for key in merged:
                if key not in meta:
                    raise ValueError(
                        f"meta key {key!r} is in {what} {holders[key]} but not in {what} {position}"
                    )
    return merged


def tensor_items(
    tensors: TensorDict | Mapping[str, torch.Tensor] | None,
) -> tuple[dict[str, torch.Tensor], int | None]:
    """Validated flat `{key: tensor}` and, for a TensorDict input with a batch size, its first dim."""
    if tensors is None:
        return {}, None
    declared_size = None
    if isinstance(tensors, TensorDict):
        if tensors.batch_dims >= 1:
            declared_size = int(tensors.batch_size[0])
        items = dict(tensors.items())
    elif isinstance(tensors, Mapping):
        items = dict(tensors)
    else:
        raise TypeError(f"tensors must be a TensorDict or a dict of tensors, got {type(tensors).__name__}")
    for key, value in items.items():
        check_key(key)
        if isinstance(value, TensorDict):
            raise ValueError(
                f"nested TensorDict under {key!r} is not supported; flatten it (td.flatten_keys())"
            )
        check_tensor(key, value)
    return items, declared_size


def common_first_dim(sizes: list[tuple[str, int]], declared_size: int | None) -> int:
    """The shared first dimension; a ValueError naming the first key that disagrees."""
    if declared_size is not None:
        reference_key, reference_size = "the TensorDict batch_size", declared_size
    elif sizes:
        reference_key, reference_size = repr(sizes[0][0]), sizes[0][1]
    else:
        return 0
    for key, size in sizes:
        if size != reference_size:
            raise ValueError(
                f"key {key!r} has {size} samples (first dimension) but {reference_key} has {reference_size}"
            )
    return reference_size


def check_same_layout(batches: list) -> None:
    """Same keys, dtypes and trailing shapes in every batch (torch.cat would silently promote dtypes)."""
    first = batches[0]
    for position, batch in enumerate(batches[1:], start=1):
        for kind, mine, theirs in (
            ("tensor", first.tensor_keys, batch.tensor_keys),
            ("non-tensor", first.non_tensor_keys, batch.non_tensor_keys),
        ):
            if set(mine) != set(theirs):
                key = sorted(set(mine) ^ set(theirs))[0]
                holder, other = (0, position) if key in mine else (position, 0)
                raise ValueError(f"concat: {kind} key {key!r} is in batch {holder} but not in batch {other}")
        for key in first.keys():
            a, b = first[key], batch[key]
            # numpy strings of different widths ('<U3', '<U5') concatenate fine; torch dtypes must match.
            same_dtype = a.dtype.kind == b.dtype.kind if isinstance(a, np.ndarray) else a.dtype == b.dtype
            if not same_dtype or a.shape[1:] != b.shape[1:]:
                raise ValueError(
                    f"concat: key {key!r} is {dtype_name(a.dtype)}{list(a.shape[1:])} per sample in "
                    f"batch 0 but {dtype_name(b.dtype)}{list(b.shape[1:])} in batch {position}"
                )
