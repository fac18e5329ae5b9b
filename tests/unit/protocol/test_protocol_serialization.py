"""Pickling a Batch: tensors travel as contiguous out-of-band buffers, never element by element."""

import copy
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from protocol_strategies import make_batch

from ballast.protocol import Batch
from ballast.protocol.batch import _restore_batch

ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int8, torch.uint8, torch.bool, torch.complex64,
]
ALL_DTYPES_KEYS = [str(dtype) for dtype in ALL_DTYPES] + ["wide"]


def dtype_zoo(num_samples: int) -> Batch:
    generator = torch.Generator().manual_seed(num_samples)
    tensors = {}
    for dtype in ALL_DTYPES:
        raw = torch.randn(num_samples, 3, generator=generator) * 50
        tensors[str(dtype)] = raw > 0 if dtype == torch.bool else raw.to(dtype)
    tensors["wide"] = torch.randn(num_samples, 2, 5, generator=generator)
    uids = [f"uid-{i}" for i in range(num_samples)]
    truths = [{"ground_truth": str(i * 7)} for i in range(num_samples)]
    return Batch(tensors, {"uid": uids, "reward_model": truths}, {"step": 3, "names": {"x": [1.5]}})


def tensor_bytes(batch: Batch) -> int:
    return sum(t.numel() * t.element_size() for t in batch.tensors.values())


def dumps_out_of_band(obj) -> tuple[bytes, list[pickle.PickleBuffer]]:
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return payload, buffers


def test_out_of_band_buffers_hold_exactly_the_tensor_bytes_and_round_trip():
    batch = dtype_zoo(64)
    payload, buffers = dumps_out_of_band(batch)
    assert len(buffers) == len(batch.tensor_keys)
    assert sum(buffer.raw().nbytes for buffer in buffers) == tensor_bytes(batch)
    restored = pickle.loads(payload, buffers=buffers)
    assert restored.equals(batch)
    for key in batch.tensor_keys:
        assert restored[key].dtype == batch[key].dtype and restored[key].shape == batch[key].shape
    assert list(restored["uid"]) == list(batch["uid"]) and restored["reward_model"][5] == {"ground_truth": "35"}
    assert restored.meta == {"step": 3, "names": {"x": [1.5]}}


def test_in_band_payload_does_not_grow_with_tensor_size():
    small, large = dtype_zoo(4).select(ALL_DTYPES_KEYS), dtype_zoo(4096).select(ALL_DTYPES_KEYS)
    small_payload, _ = dumps_out_of_band(small)
    large_payload, large_buffers = dumps_out_of_band(large)
    assert tensor_bytes(large) > 300_000
    assert len(large_payload) < 2048, "tensor data leaked into the in-band payload"
    assert abs(len(large_payload) - len(small_payload)) <= 64
    assert sum(b.raw().nbytes for b in large_buffers) == tensor_bytes(large)


def test_numeric_non_tensors_also_travel_out_of_band():
    batch = make_batch(100)
    _, buffers = dumps_out_of_band(batch)
    assert sum(b.raw().nbytes for b in buffers) == tensor_bytes(batch) + batch["score"].nbytes


def test_in_band_protocol_4_writes_whole_buffers():
    batch = dtype_zoo(2048).select(ALL_DTYPES_KEYS)
    payload = pickle.dumps(batch, protocol=4)
    assert len(payload) < tensor_bytes(batch) + 4096
    assert pickle.loads(payload).equals(batch)


def test_non_contiguous_and_sliced_tensors_send_only_their_elements():
    base = torch.arange(40, dtype=torch.float32).reshape(4, 10)
    batch = Batch({"transposed": base.t()[:4], "strided": base[:, ::2]})
    sliced = make_batch(100)[10:20].select(["logp"])
    for item in (batch, sliced):
        payload, buffers = dumps_out_of_band(item)
        assert sum(b.raw().nbytes for b in buffers) == tensor_bytes(item)
        restored = pickle.loads(payload, buffers=buffers)
        assert restored.equals(item)
        assert all(restored[key].is_contiguous() for key in restored.tensor_keys)


def test_writable_buffers_are_used_without_copy():
    batch = make_batch(8).select(["logp"])
    payload, buffers = dumps_out_of_band(batch)
    restored = pickle.loads(payload, buffers=buffers)
    assert restored["logp"].data_ptr() == batch["logp"].data_ptr()


def test_read_only_buffers_are_copied_into_writable_tensors():
    # Ray hands out read-only views of its object store; simulate that with bytes buffers.
    batch = dtype_zoo(16)
    payload, buffers = dumps_out_of_band(batch)
    read_only = [memoryview(bytes(buffer.raw())) for buffer in buffers]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when wrapping a non-writable numpy array
        restored = pickle.loads(payload, buffers=read_only)
    assert restored.equals(batch)
    restored["torch.float32"].mul_(2)
    assert torch.equal(restored["torch.float32"], batch["torch.float32"] * 2)


def test_detached_grad_tensors_and_empty_batches_round_trip():
    weights = torch.randn(3, 2, requires_grad=True)
    batch = Batch({"w": weights * 2, "none": torch.zeros(3, 0, dtype=torch.bfloat16)})
    restored = pickle.loads(pickle.dumps(batch, protocol=5))
    assert not restored["w"].requires_grad and torch.equal(restored["w"], (weights * 2).detach())
    assert restored["none"].shape == (3, 0) and restored["none"].dtype == torch.bfloat16
    for empty in (Batch(), Batch(meta={"names": {"a": [1]}}), make_batch(0)):
        assert pickle.loads(pickle.dumps(empty, protocol=5)).equals(empty)


def test_copy_and_deepcopy_go_through_the_same_state():
    batch = make_batch(5, meta={"nested": {"a": [1]}})
    shallow, deep = copy.copy(batch), copy.deepcopy(batch)
    assert shallow.equals(batch) and deep.equals(batch)
    deep["logp"][0, 0] = 42.0
    deep.meta["nested"]["a"].append(2)
    assert batch["logp"][0, 0] != 42.0 and batch.meta["nested"]["a"] == [1]


def test_unknown_state_version_is_rejected():
    with pytest.raises(ValueError, match="cannot restore Batch state version 99"):
        _restore_batch({"version": 99})


def test_protocol_package_does_not_import_ray():
    assert "ballast.protocol" in sys.modules
    if "ray" not in sys.modules:
        return  # ballast.protocol is imported in this process and ray is not: nothing pulled it in
    # Another test imported ray first; check in a fresh interpreter instead (slower: imports torch).
    code = "import sys, ballast.protocol; sys.exit(3 if 'ray' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"ballast.protocol imported ray (rc={result.returncode}): {result.stderr[-2000:]}"


def test_round_trip_is_bit_exact():
    # `equals` compares values (0.0 == -0.0); the wire format must preserve the bits themselves.
    batch = dtype_zoo(5)
    batch["signed_zero"] = torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0], dtype=torch.bfloat16)
    restored = pickle.loads(pickle.dumps(batch, protocol=5))
    for key in ("torch.bfloat16", "signed_zero"):
        assert np.array_equal(restored[key].view(torch.int16).numpy(), batch[key].view(torch.int16).numpy())
