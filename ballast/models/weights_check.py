"""Cheap checks of a Hugging Face model directory's weight files, run before any worker loads them.

A truncated or half-copied `model.safetensors` otherwise surfaces only inside a worker, after Ray and
the engine have started, as a generic worker failure. Here every safetensors file's header is read
(8-byte length + JSON; no tensor data) and its size compared with what the header promises, and a
sharded checkpoint's index is checked to name only files that exist. Errors name the file.
"""

from __future__ import annotations

import json
import os
import struct
from typing import List

# A header is a JSON dict of tensor names to dtype/shape/offsets; 100 MB is far above any real one
# and stops a garbage length from making us read the whole file.
_MAX_HEADER_BYTES = 100 << 20


class ModelFilesError(ValueError):
    """A weight file of the model directory is missing, truncated or not a safetensors file."""


def check_safetensors_file(path: str) -> None:
    """Raise `ModelFilesError` naming `path` unless its header parses and its size matches it."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFilesError(f"model file {path!r} has {size} bytes: too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise ModelFilesError(f"model file {path!r} ({size} bytes) claims a {header_len}-byte header: "
                                  "truncated or not a safetensors file")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as err:
            raise ModelFilesError(f"model file {path!r}: unreadable safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise ModelFilesError(f"model file {path!r}: the safetensors header is not a JSON object")
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            data_end = max(data_end, int(info["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise ModelFilesError(f"model file {path!r}: tensor {name!r} has no valid data_offsets") from None
    expected = 8 + header_len + data_end
    if size < expected:
        raise ModelFilesError(f"model file {path!r} has {size} bytes but its header describes {expected}: "
                              "the file is truncated (an interrupted download or copy?)")


def check_model_files(model_dir: str) -> List[str]:
    """Check every weight file of `model_dir` (and the shard index); returns the files checked."""
    checked = []
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ModelFilesError(f"model index {index_path!r} is unreadable or has no weight_map ({err})") from None
        for shard in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(model_dir, shard)):
                raise ModelFilesError(f"model index {index_path!r} names {shard!r}, which is not in {model_dir!r}")
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            path = os.path.join(model_dir, name)
            check_safetensors_file(path)
            checked.append(path)
    return checked
