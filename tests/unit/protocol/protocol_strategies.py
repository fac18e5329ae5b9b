"""Hypothesis strategies and builders for Batch tests: random batches whose every row is traceable.

Each generated batch carries a `row` int64 tensor and a `tag` object array holding the sample's
original position, so a property test can say exactly where each sample ended up.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from ballast.protocol import Batch

TENSOR_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16, torch.int8]


def make_tensor(generator: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=generator, dtype=dtype)


def make_batch(num_samples: int, seed: int = 0, trailing: int = 3, meta: dict | None = None) -> Batch:
    """A deterministic mixed batch: several dtypes, a 1-D and a 2-D tensor, object and numeric arrays."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "row": torch.arange(num_samples, dtype=torch.int64),
        "tokens": make_tensor(generator, (num_samples, trailing), torch.int64),
        "logp": make_tensor(generator, (num_samples, trailing), torch.float32),
        "half": make_tensor(generator, (num_samples, trailing), torch.bfloat16),
        "mask": make_tensor(generator, (num_samples, trailing), torch.bool),
    }
    tags = [f"s{i}" for i in range(num_samples)]
    non_tensors = {"tag": tags, "score": np.arange(num_samples, dtype=np.float64) / 2}
    return Batch(tensors, non_tensors, {"temperature": 1.0} if meta is None else meta)


@st.composite
def batches(draw, min_samples: int = 0, max_samples: int = 12) -> Batch:
    """Random batches: random size, random extra tensor fields of random dtype/trailing shape."""
    num_samples = draw(st.integers(min_samples, max_samples))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    tensors = {"row": torch.arange(num_samples, dtype=torch.int64)}
    num_extra = draw(st.integers(0, 3))
    for position in range(num_extra):
        dtype = draw(st.sampled_from(TENSOR_DTYPES))
        trailing = tuple(draw(st.lists(st.integers(1, 4), max_size=2)))
        tensors[f"t{position}"] = make_tensor(generator, (num_samples, *trailing), dtype)
    non_tensors = {"tag": [f"s{i}" for i in range(num_samples)]}
    if draw(st.booleans()):
        non_tensors["payload"] = [{"ground_truth": str(i), "ids": list(range(i % 3))} for i in range(num_samples)]
    meta = draw(st.dictionaries(st.sampled_from(["step", "temperature", "name"]), st.integers(0, 5), max_size=2))
    return Batch(tensors, non_tensors, meta)


def rows(batch: Batch) -> list[int]:
    """Original positions of the samples, read from the tensor and checked against the object array."""
    tensor_rows = batch["row"].tolist()
    assert [f"s{r}" for r in tensor_rows] == list(batch["tag"]), "tensor and non-tensor rows diverged"
    return tensor_rows
