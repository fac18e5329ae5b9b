"""Reading checkpoint files without letting them run code.

torch.distributed.checkpoint (DCP) pickles two things: the checkpoint's `.metadata` and every
non-tensor value of the state, such as the optimizer's hyper-parameters, and reads both back with
unrestricted unpicklers (the standard library's and torch's with its weights-only check turned off).
A pickle can name any callable to run when it is read, so a checkpoint handed to someone, or one
rewritten together with its checksums, could run code on resume. Here:

* `read_dcp_metadata` unpickles `.metadata` with an unpickler that can build DCP's own metadata
  classes, `torch.Size`, dtypes, layouts and paths, and nothing else (Python's documented way of
  restricting what a pickle may load: every callable a pickle names goes through `find_class`);
* `SafeReader` / `SafePlanner` are DCP's file reader and load planner with those two reads replaced
  (the non-tensor values by `torch.load(weights_only=True)`, PyTorch's own restricted loader), and
  `load_dcp` is `dcp.load` through them;
* `load_torch_file` is `torch.load(weights_only=True)` for the engine's small state file, and
  `check_adapter_weights` the same check of a PEFT adapter's weights before any worker loads them.

Whatever they refuse is a `RefusedFileError` naming the file (and the item inside it).
"""

from __future__ import annotations

import io
import os
import pickle
import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA_FILE = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = frozenset({
    *((_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                          "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                          "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by its name
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"),
})
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's file names, in its order
WHY = "it holds more than tensors and plain values (a pickle that could run code when read)"


class RefusedFileError(ValueError):
    """A checkpoint or adapter file that holds something other than tensors and plain values."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's metadata never needs")


def read_dcp_metadata(path: str) -> Metadata:
    """The `Metadata` DCP wrote to `path`; `RefusedFileError` for anything else."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as err:
        raise RefusedFileError(f"{path}: refused: {WHY}: {err}") from None
    if not isinstance(metadata, Metadata):
        raise RefusedFileError(f"{path}: refused: it holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def load_torch_file(path: str, what: str = ""):
    """`torch.load(path, weights_only=True)`; a refusal is a `RefusedFileError` naming `path` (and `what`)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise RefusedFileError(f"{path}{what}: refused by torch.load(weights_only=True): {WHY}: {_reason(err)}") from None


def _reason(err: Exception) -> str:
    """The line of torch's refusal that says what the file names (the rest is advice to load it anyway)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(err).splitlines()]
    said = next((line for line in lines if line.startswith("WeightsUnpickler error:")), None)
    if said is None:
        return next((line for line in lines if line), type(err).__name__)
    return said.removeprefix("WeightsUnpickler error:").strip().split(". ")[0]  # then: how to allow it


def check_adapter_weights(directory: str) -> str:
    """The weights file of the PEFT adapter in `directory`, as PEFT picks it: `adapter_model.safetensors`
    (a format that cannot run code), else `adapter_model.bin` once `torch.load(weights_only=True)` has
    read it (PEFT reads it the same way). `RefusedFileError` naming the file, or none found."""
    for name in ADAPTER_WEIGHTS:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            if name.endswith(".bin"):
                load_torch_file(path)
            return path
    raise RefusedFileError(f"{directory} holds neither {' nor '.join(ADAPTER_WEIGHTS)}")


class SafeReader(FileSystemReader):
    """DCP's file reader, reading `.metadata` with `read_dcp_metadata`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = read_dcp_metadata(os.path.join(str(self.path), name))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with `torch.load(weights_only=True)`."""

    def __init__(self, checkpoint_dir: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.checkpoint_dir = checkpoint_dir

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise RefusedFileError(f"{self.checkpoint_dir}: item {fqn!r} refused by torch.load(weights_only=True): "
                                   f"{WHY}: {_reason(err)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load_dcp(state: dict, checkpoint_dir: str) -> None:
    """`dcp.load(state)` from `checkpoint_dir` through `SafeReader` and `SafePlanner`. Collective. A refusal
    is the `RefusedFileError` naming the file or item (DCP reports its readers' errors wrapped)."""
    read_dcp_metadata(os.path.join(checkpoint_dir, METADATA_FILE))  # refused here, by name, before DCP reads it
    try:
        dcp.load(state, storage_reader=SafeReader(checkpoint_dir), planner=SafePlanner(checkpoint_dir))
    except CheckpointException as err:
        refused = next((exc for exc, _ in err.failures.values() if isinstance(exc, RefusedFileError)), None)
        if refused is not None:
            raise refused from None
        raise
