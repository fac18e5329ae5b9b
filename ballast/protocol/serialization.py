"""How a `Batch`'s tensors cross process boundaries (Ray object store, pickle).

Each tensor becomes one contiguous 1-D `uint8` numpy array plus its dtype name and shape. Under
pickle protocol 5, numpy hands such arrays to `buffer_callback` as out-of-band `PickleBuffer`s,
which is what Ray's serializer uses for zero-copy transfer; the in-band payload holds only keys,
dtype names and shapes. Under older protocols the same array is written as one bytes blob. Either
way no tensor is pickled element by element.

Viewing every dtype as bytes covers dtypes numpy lacks (bfloat16, float8) and bool with one code
path. Tensors are detached, moved to CPU and made contiguous first (a contiguous slice of a bigger
tensor sends only its own bytes), so a received tensor always lives on CPU.

On the receiving side a writable buffer (plain `pickle.loads`) is used in place. A read-only buffer
(Ray hands out views of its shared-memory object store) is copied once: torch assumes tensor
memory is writable, and an in-place op on read-only shared memory would crash the worker.
"""

from __future__ import annotations

import numpy as np
import torch

STATE_VERSION = 1


def tensor_to_bytes_array(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of the tensor's bytes (copying only if it is not already contiguous CPU)."""
    tensor = tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    if tensor.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return tensor.reshape(-1).view(torch.uint8).numpy()


def tensor_from_bytes_array(data: np.ndarray, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"serialized tensor has unknown dtype {dtype_name!r}")
    expected_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if data.nbytes != expected_bytes:
        raise ValueError(
            f"serialized tensor of shape {shape} and dtype {dtype_name} needs {expected_bytes} "
            f"bytes, got {data.nbytes}"
        )
    if expected_bytes == 0:
        # A zero-length byte tensor cannot be re-viewed as a wider dtype.
        return torch.empty(shape, dtype=dtype)
    if not data.flags.writeable:
        data = data.copy()
    return torch.from_numpy(data).view(dtype).reshape(shape)


TensorState = tuple[str, str, tuple[int, ...], np.ndarray]
"""(key, dtype name, shape, flat uint8 array) for one tensor."""


def tensors_to_state(tensors: dict[str, torch.Tensor]) -> list[TensorState]:
    """(key, dtype name, shape, bytes array) per tensor, in key order."""
    return [
        (key, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor_to_bytes_array(tensor))
        for key, tensor in tensors.items()
    ]


def tensors_from_state(entries: list[TensorState]) -> dict[str, torch.Tensor]:
    return {key: tensor_from_bytes_array(data, dtype_name, shape) for key, dtype_name, shape, data in entries}
