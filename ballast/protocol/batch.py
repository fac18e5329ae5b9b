"""`Batch`: the per-sample data container that travels between the driver and the Ray workers.

A Batch holds three things that share one sample dimension of length N:

* `tensors`: a `tensordict.TensorDict` with `batch_size=[N]` (token ids, masks, log-probs, ...);
* `non_tensors`: `dict[str, np.ndarray]`, each array with first dimension N (uids, data sources,
  ground truths: usually dtype=object);
* `meta`: a plain dict for per-batch values (temperature, step, `meta["metrics"]`).

Canonical keys and shapes are listed in `ballast.protocol.fields`. Operations either return a new
Batch (`select`, `union`, `chunk`, `reordered`, `repeat`, ...) or say that they mutate in place
(`pop`, `reorder`, `__setitem__`). New Batches share tensor memory with their source wherever torch
would (slices are views, index arrays copy) and get a shallow copy of `meta`; `clone()` copies
everything. Pickling sends tensors as contiguous buffers (see `serialization.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from ballast.protocol import _checks
from ballast.protocol.serialization import STATE_VERSION, tensors_from_state, tensors_to_state

PAD_COUNT_KEY = "pad_count"
"""Meta key recording how many trailing samples `pad_to_divisor` / `chunk(pad=True)` appended."""


class Batch:
    """Tensors + per-sample numpy arrays + meta, all indexed by one sample dimension."""

    def __init__(
        self,
        tensors: TensorDict | Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, np.ndarray | Sequence] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        tensor_items, declared_size = _checks.tensor_items(tensors)
        array_items = {
            _checks.check_key(key): _checks.as_non_tensor_array(key, value)
            for key, value in (non_tensors or {}).items()
        }
        for key in array_items:
            if key in tensor_items:
                raise ValueError(f"key {key!r} is given both as a tensor and as a non-tensor")
        num_samples = _checks.common_first_dim(
            [(key, value.shape[0]) for key, value in tensor_items.items()]
            + [(key, value.shape[0]) for key, value in array_items.items()],
            declared_size,
        )
        if meta is not None and not isinstance(meta, Mapping):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
        meta = dict(meta or {})
        self._tensors = TensorDict(tensor_items, batch_size=[num_samples])
        self._non_tensors: dict[str, np.ndarray] = array_items
        self.meta: dict[str, Any] = meta

    @classmethod
    def _build(cls, tensors: TensorDict, non_tensors: dict[str, np.ndarray], meta: dict) -> Batch:
        """Construct from parts an operation has already made consistent (no re-validation)."""
        assert all(len(v) == tensors.batch_size[0] for v in non_tensors.values())
        batch = cls.__new__(cls)
        batch._tensors, batch._non_tensors, batch.meta = tensors, non_tensors, meta
        return batch

    # ----------------------------------------------------------------- access
    @property
    def tensors(self) -> TensorDict:
        """The TensorDict of tensor fields (batch_size [N]); what the engine consumes."""
        return self._tensors

    @property
    def non_tensors(self) -> dict[str, np.ndarray]:
        return self._non_tensors

    @property
    def batch_size(self) -> int:
        """Number of samples N (same as `len(batch)`)."""
        return int(self._tensors.batch_size[0])

    def __len__(self) -> int:
        return self.batch_size

    @property
    def tensor_keys(self) -> list[str]:
        return list(self._tensors.keys())

    @property
    def non_tensor_keys(self) -> list[str]:
        return list(self._non_tensors)

    def keys(self) -> list[str]:
        """Tensor keys then non-tensor keys."""
        return self.tensor_keys + self.non_tensor_keys

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (key in self._non_tensors or key in self._tensors.keys())

    def __iter__(self):
        raise TypeError(
            "a Batch is not iterable (ambiguous between keys and samples): "
            "use batch.keys() or batch.split(1)"
        )

    def __getitem__(self, index: Any) -> Any:
        """A str key returns its tensor/array; any sample index returns a Batch (ints keep the dim)."""
        if isinstance(index, str):
            if index in self._non_tensors:
                return self._non_tensors[index]
            if index in self._tensors.keys():
                return self._tensors[index]
            raise KeyError(f"no key {index!r} in Batch; keys: {self.keys()}")
        position = _checks.normalize_index(index, len(self))
        torch_position = position if isinstance(position, slice) else torch.from_numpy(position)
        return Batch._build(
            self._tensors[torch_position],
            {key: value[position] for key, value in self._non_tensors.items()},
            dict(self.meta),
        )

    def __setitem__(self, key: str, value: torch.Tensor | np.ndarray | Sequence) -> None:
        """Add or replace a field (a tensor, or a numpy array/list as a non-tensor), in place.

        A Batch without any field adopts the new field's first dimension as its size.
        """
        _checks.check_key(key)
        if isinstance(value, torch.Tensor):
            value = _checks.check_tensor(key, value)
        else:
            value = _checks.as_non_tensor_array(key, value)
        if len(value) != len(self) and self.keys():
            raise ValueError(
                f"key {key!r} has {len(value)} samples (first dimension) but the batch has {len(self)}"
            )
        if not self.keys() and len(value) != len(self):
            self._tensors = TensorDict({}, batch_size=[len(value)])
        self._delete(key)
        if isinstance(value, torch.Tensor):
            self._tensors[key] = value
        else:
            self._non_tensors[key] = value

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(f"no key {key!r} in Batch; keys: {self.keys()}")
        self._delete(key)

    def _delete(self, key: str) -> None:
        if key in self._non_tensors:
            del self._non_tensors[key]
        elif key in self._tensors.keys():
            del self._tensors[key]

    # ----------------------------------------------------------- key subsets
    def select(self, keys: str | Iterable[str]) -> Batch:
        """A Batch with only `keys` (tensor and/or non-tensor), sharing their data; meta is copied."""
        keys = self._existing_keys(keys)
        tensor_keys = [key for key in keys if key not in self._non_tensors]
        return Batch._build(
            self._tensors.select(*tensor_keys),
            {key: self._non_tensors[key] for key in keys if key in self._non_tensors},
            dict(self.meta),
        )

    def pop(self, keys: str | Iterable[str]) -> Batch:
        """Remove `keys` from this Batch (in place) and return them as a new Batch with a copy of meta."""
        popped = self.select(keys)
        for key in popped.keys():
            self._delete(key)
        return popped

    def _existing_keys(self, keys: str | Iterable[str]) -> list[str]:
        keys = [keys] if isinstance(keys, str) else list(keys)
        for key in keys:
            if key not in self:
                raise KeyError(f"no key {key!r} in Batch; keys: {self.keys()}")
        return keys

    def union(self, other: Batch) -> Batch:
        """A Batch with the fields of both; shared keys must hold equal values, sizes must match.

        Meta keys are pooled; a key in both must hold equal values, except `meta["metrics"]`, whose
        lists are extended. Neither operand is modified.
        """
        if not isinstance(other, Batch):
            raise TypeError(f"union needs a Batch, got {type(other).__name__}")
        if len(other) != len(self) and (self.keys() and other.keys()):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} samples")
        for key in other.keys():
            if key not in self:
                continue
            mine, theirs = self[key], other[key]
            if type(mine) is not type(theirs) or not _checks.values_equal(mine, theirs):
                raise ValueError(
                    f"union: key {key!r} differs between the two batches "
                    f"({_checks.describe_value(mine)} vs {_checks.describe_value(theirs)})"
                )
        size = len(self) if self.keys() else len(other)
        tensors = dict(self._tensors.items())
        tensors.update((key, value) for key, value in other.tensors.items() if key not in tensors)
        non_tensors = dict(self._non_tensors)
        non_tensors.update((key, value) for key, value in other.non_tensors.items() if key not in non_tensors)
        meta = _checks.merge_meta([self.meta, other.meta], "operand", same_keys=False)
        return Batch._build(TensorDict(tensors, batch_size=[size]), non_tensors, meta)

    # -------------------------------------------------------- slicing/merging
    def chunk(self, num_chunks: int, pad: bool = False) -> list[Batch]:
        """Split into `num_chunks` equal-size views, in order.

        If N is not divisible by `num_chunks` this is a ValueError unless `pad=True`, which first
        appends copies of the leading samples (`pad_to_divisor`) and records the pad count in each
        chunk's `meta["pad_count"]`, so `Batch.concat(results).unpad()` restores N samples.
        """
        num_chunks = _checks.check_positive_int("num_chunks", num_chunks)
        source = self
        if len(self) % num_chunks:
            if not pad:
                raise ValueError(
                    f"cannot chunk {len(self)} samples into {num_chunks} equal chunks "
                    f"({len(self)} % {num_chunks} = {len(self) % num_chunks}); pass pad=True to pad"
                )
        if pad:
            source, _ = self.pad_to_divisor(num_chunks)
        chunk_size = len(source) // num_chunks
        return [source[i * chunk_size : (i + 1) * chunk_size] for i in range(num_chunks)]

    def split(self, split_size: int) -> list[Batch]:
        """Consecutive views of `split_size` samples; the last one may be shorter (none if N == 0)."""
        split_size = _checks.check_positive_int("split_size", split_size)
        return [self[start : start + split_size] for start in range(0, len(self), split_size)]

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        """Concatenate along the sample dimension.

        All batches need the same keys with the same dtype and trailing shape; meta must agree
        except `meta["metrics"]`, whose lists are extended in batch order.
        """
        batches = list(batches)
        if not batches:
            raise ValueError("concat needs at least one Batch")
        for position, batch in enumerate(batches):
            if not isinstance(batch, Batch):
                raise TypeError(f"concat: item {position} is a {type(batch).__name__}, not a Batch")
        _checks.check_same_layout(batches)
        first = batches[0]
        tensors = torch.cat([batch.tensors for batch in batches], dim=0)
        non_tensors = {
            key: np.concatenate([batch.non_tensors[key] for batch in batches], axis=0)
            for key in first.non_tensor_keys
        }
        meta = _checks.merge_meta([batch.meta for batch in batches], "batch", same_keys=True)
        return Batch._build(tensors, non_tensors, meta)

    # ------------------------------------------------------------- reordering
    def reordered(self, indices: Any) -> Batch:
        """A new Batch whose sample i is this batch's sample `indices[i]`; `indices` must be a permutation."""
        return self[_checks.check_permutation(indices, len(self))]

    def reorder(self, indices: Any) -> None:
        """In-place `reordered`: this Batch's fields are replaced by their permuted copies."""
        permuted = self.reordered(indices)
        self._tensors, self._non_tensors = permuted._tensors, permuted._non_tensors

    def repeat(self, repeat_times: int, interleave: bool = True) -> Batch:
        """Each sample `repeat_times` times: adjacent copies ([a,a,b,b]) or tiled ([a,b,a,b])."""
        repeat_times = _checks.check_positive_int("repeat_times", repeat_times)
        if interleave:
            tensors = self._tensors.repeat_interleave(repeat_times, dim=0)
            non_tensors = {k: np.repeat(v, repeat_times, axis=0) for k, v in self._non_tensors.items()}
        else:
            tensors = self._tensors.repeat(repeat_times)
            non_tensors = {
                k: np.concatenate([v] * repeat_times, axis=0) for k, v in self._non_tensors.items()
            }
        return Batch._build(tensors, non_tensors, dict(self.meta))

    # ---------------------------------------------------------------- padding
    def pad_to_divisor(self, divisor: int) -> tuple[Batch, int]:
        """Append copies of the leading samples until N is a multiple of `divisor`.

        Returns the padded Batch and the number of samples added; the padded Batch's
        `meta["pad_count"]` is the total number of trailing pad samples (earlier padding included).
        """
        divisor = _checks.check_positive_int("divisor", divisor)
        pad_count = -len(self) % divisor
        if pad_count:
            order = np.concatenate([np.arange(len(self)), np.arange(pad_count) % len(self)])
            padded = self[order]
        else:
            padded = self[:]
        padded.meta[PAD_COUNT_KEY] = int(self.meta.get(PAD_COUNT_KEY, 0)) + pad_count
        return padded, pad_count

    def unpad(self, pad_count: int | None = None) -> Batch:
        """Drop the last `pad_count` samples (default: `meta["pad_count"]`) and update that record."""
        recorded = self.meta.get(PAD_COUNT_KEY)
        if pad_count is None:
            if recorded is None:
                raise ValueError(
                    f"unpad() without a count needs meta[{PAD_COUNT_KEY!r}], which this batch lacks"
                )
            pad_count = recorded
        if isinstance(pad_count, bool) or not isinstance(pad_count, (int, np.integer)) or pad_count < 0:
            raise ValueError(f"pad_count must be a non-negative integer, got {pad_count!r}")
        if pad_count > len(self):
            raise ValueError(f"cannot remove {pad_count} pad samples from a batch of {len(self)}")
        if recorded is not None and pad_count > recorded:
            raise ValueError(
                f"unpad({pad_count}) removes more than the {recorded} pad samples recorded "
                f"in meta[{PAD_COUNT_KEY!r}]"
            )
        result = self[: len(self) - pad_count]
        if recorded is not None:
            remaining = int(recorded) - int(pad_count)
            if remaining:
                result.meta[PAD_COUNT_KEY] = remaining
            else:
                del result.meta[PAD_COUNT_KEY]
        return result

    # ----------------------------------------------------- conversion/copying
    def to_dict(self) -> dict[str, dict]:
        """`{"tensors": {key: Tensor}, "non_tensors": {key: ndarray}, "meta": {...}}` (no copies)."""
        return {
            "tensors": dict(self._tensors.items()),
            "non_tensors": dict(self._non_tensors),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> Batch:
        """Inverse of `to_dict`; also accepts a flat `{key: Tensor | ndarray | list}` dict.

        The input is read as the `to_dict` layout when every key is one of "tensors", "non_tensors",
        "meta" and every value is a dict; otherwise tensors go to `tensors` and the rest to
        `non_tensors`, with `meta` taken from the argument.
        """
        sections = {"tensors", "non_tensors", "meta"}
        if data and set(data) <= sections and all(isinstance(v, Mapping) for v in data.values()):
            if meta is not None:
                raise ValueError("from_dict: give meta either inside the dict or as an argument, not both")
            return cls(data.get("tensors"), data.get("non_tensors"), data.get("meta"))
        tensors = {key: value for key, value in data.items() if isinstance(value, torch.Tensor)}
        others = {key: value for key, value in data.items() if not isinstance(value, torch.Tensor)}
        return cls(tensors, others, meta)

    def to(self, device: str | torch.device) -> Batch:
        """A Batch with the tensors on `device` (non-tensors and meta are shared/shallow-copied)."""
        return Batch._build(self._tensors.to(device), dict(self._non_tensors), dict(self.meta))

    def clone(self) -> Batch:
        """A deep copy: tensors cloned, arrays copied (object elements deep-copied), meta deep-copied."""
        non_tensors = {
            key: copy.deepcopy(value) if value.dtype == object else value.copy()
            for key, value in self._non_tensors.items()
        }
        return Batch._build(self._tensors.clone(), non_tensors, copy.deepcopy(self.meta))

    def equals(self, other: Batch) -> bool:
        """Same keys, dtypes, shapes and values (NaN == NaN) and equal meta."""
        return (
            isinstance(other, Batch)
            and len(self) == len(other)
            and sorted(self.tensor_keys) == sorted(other.tensor_keys)
            and sorted(self.non_tensor_keys) == sorted(other.non_tensor_keys)
            and all(_checks.values_equal(self[key], other[key]) for key in self.keys())
            and _checks.values_equal(self.meta, other.meta)
        )

    def __repr__(self) -> str:
        tensor_text = ", ".join(
            f"{key}: {_checks.dtype_name(value.dtype)}{list(value.shape)} {value.device}"
            for key, value in self._tensors.items()
        )
        array_text = ", ".join(
            f"{key}: {value.dtype}{list(value.shape)}" for key, value in self._non_tensors.items()
        )
        return (
            f"Batch(num_samples={len(self)},\n  tensors={{{tensor_text}}},\n"
            f"  non_tensors={{{array_text}}},\n  meta_keys={list(self.meta)})"
        )

    def __reduce__(self):
        state = {
            "version": STATE_VERSION,
            "num_samples": len(self),
            "tensors": tensors_to_state(dict(self._tensors.items())),
            "non_tensors": self._non_tensors,
            "meta": self.meta,
        }
        return (_restore_batch, (state,))


def _restore_batch(state: dict) -> Batch:
    """Unpickling entry point (module level so pickle can find it by name)."""
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"cannot restore Batch state version {state.get('version')!r}; expected {STATE_VERSION}"
        )
    tensors = TensorDict(tensors_from_state(state["tensors"]), batch_size=[state["num_samples"]])
    return Batch._build(tensors, dict(state["non_tensors"]), state["meta"])
