"""Sharded checkpoints (torch.distributed.checkpoint) and full Hugging Face export.

Layout of a checkpoint directory:

* `dcp/`: model and optimizer state, sharded as they live on the mesh (every rank writes its shards;
  loading onto the same mesh shape restores them exactly);
* `engine_state.pt`: LR-scheduler state and step counters (small, identical on all ranks; written by
  rank 0, read with `weights_only=True`), and what the engine's LoRA adapter was (None: full weights).

Both are read back without letting a file run code (`ballast.engine.safe_load`): DCP's pickled
metadata and non-tensor values through restricted loaders, `engine_state.pt` with `weights_only=True`;
a file that holds anything else is a `RefusedFileError` naming it.

With a LoRA adapter the checkpoint holds the trainable parameters only (the adapter, and a critic's
value head) and their optimizer state; the frozen base weights come from the model directory again
on resume. A checkpoint resumes only into an engine with the same adapter layout (or none).

`export_hf` gathers the full weights onto rank 0 (in host memory) and writes a directory that
`AutoModelForCausalLM.from_pretrained` (or the token-classification class) loads, with the tokenizer
files copied from the source model directory; with a LoRA adapter, the merged weights, plus the PEFT
adapter itself in `lora_adapter/`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from ballast.engine.lora import ADAPTER_DIR, merged_state, save_adapter
from ballast.engine.safe_load import load_dcp, load_torch_file

ENGINE_STATE_FILE = "engine_state.pt"
DCP_DIR = "dcp"
# A pipeline engine's checkpoint also records its layout (`ballast.engine.pipeline.store`).
PIPELINE_LAYOUT_FILE = "pipeline.json"
# Files of a HF model directory that are NOT weights or the model config: tokenizer, chat template,
# generation config and the like travel with the exported model.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")
_NOT_COPIED = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}
# torch.save's zip writer reports a short write as "unexpected pos ..." without the OS error; a failed
# write with less than this much free space left is taken to be a full disk.
_LOW_SPACE_BYTES = 64 << 20


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(path: str, model, optimizer, scheduler, counters: dict[str, int],
                    adapter: dict | None = None) -> None:
    """Save model, optimizer, scheduler and counters under `path`. Collective. `adapter`: the engine's
    LoRA adapter record (None: full weights), saved and checked on load; with one, only the trainable
    parameters are written."""
    if _rank() == 0:
        os.makedirs(path, exist_ok=True)
    _barrier()
    state = _state(model, optimizer, trainable_only=adapter is not None)
    try:
        dcp.save(state, checkpoint_id=os.path.join(path, DCP_DIR))
        if _rank() == 0:
            extra = {"scheduler": scheduler.state_dict() if scheduler is not None else None,
                     "counters": dict(counters), "adapter": adapter}
            torch.save(extra, os.path.join(path, ENGINE_STATE_FILE))
    except Exception as err:
        raise_if_disk_full(err, path)
        raise
    _barrier()


def raise_if_disk_full(err: BaseException, path: str) -> None:
    """Re-raise a write failure under `path` as OSError(ENOSPC) naming the directory when the disk is full."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return
    said_enospc = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)
    if said_enospc or free < _LOW_SPACE_BYTES:
        raise OSError(errno.ENOSPC, f"No space left on device while writing {path!r} ({free} bytes free): "
                                    f"{type(err).__name__}: {err}") from err


def load_checkpoint(path: str, model, optimizer, scheduler, adapter: dict | None = None) -> dict[str, int]:
    """Restore what `save_checkpoint` wrote (same mesh shape and adapter); returns the counters. Collective."""
    dcp_dir = os.path.join(path, DCP_DIR)
    extra_file = os.path.join(path, ENGINE_STATE_FILE)
    if not os.path.isdir(dcp_dir) or not os.path.isfile(extra_file):
        raise ValueError(f"{path!r} is not an engine checkpoint (expected {DCP_DIR}/ and {ENGINE_STATE_FILE})")
    refusal = pipeline_layout_refusal(path, None)
    if refusal is not None:
        raise ValueError(refusal)
    extra = load_torch_file(extra_file)
    saved = extra.get("adapter")
    if saved != adapter:
        raise ValueError(f"checkpoint {path!r} was saved with LoRA adapter {_describe_adapter(saved)} but this "
                         f"engine has {_describe_adapter(adapter)}: resume with the same lora_rank, lora_alpha "
                         "and target modules")
    trainable_only = adapter is not None
    state = _state(model, optimizer, trainable_only)
    load_dcp(state, dcp_dir)
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
        options=StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only),
    )
    if scheduler is not None:
        if extra["scheduler"] is None:
            raise ValueError(f"checkpoint {path!r} has no scheduler state but this engine has a scheduler")
        scheduler.load_state_dict(extra["scheduler"])
    return dict(extra["counters"])


def saved_pipeline_layout(path: str) -> dict | None:
    """The pipeline layout the engine checkpoint at `path` was saved with (None: no pipeline)."""
    file = os.path.join(path, PIPELINE_LAYOUT_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{file} is unreadable ({err})") from None


def pipeline_layout_refusal(path: str, layout: dict | None, key: str = "pipeline_model_parallel_size") -> str | None:
    """None when the checkpoint at `path` was saved with the pipeline `layout` (None: an engine without
    pipeline parallelism), else why it cannot resume, naming both layouts and `key`. Each rank's
    optimizer state belongs to the stages it held, so a checkpoint resumes only under its own layout;
    its HF export starts a run under any."""
    saved = saved_pipeline_layout(path)
    if saved == layout:
        return None
    return (f"checkpoint {path!r} was saved with {_describe_layout(saved)}, this engine has {_describe_layout(layout)}: "
            "a checkpoint "
            f"resumes only under the layout it was saved with (each rank's optimizer state is its stages'); set "
            f"{key}={1 if saved is None else saved['pipeline_model_parallel_size']} (and the same virtual stages) "
            "to resume, or start a new run from the checkpoint's HF export (weights only)")


def _describe_layout(record: dict | None) -> str:
    return "no pipeline parallelism" if record is None else f"the pipeline layout {record}"


def _describe_adapter(record: dict | None) -> str:
    if record is None:
        return "none (full weights)"
    return f"(rank {record['r']}, alpha {record['lora_alpha']}, {len(record['modules'])} modules)"


def _state(model, optimizer, trainable_only: bool = False) -> dict:
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    if optimizer is None:
        model_sd, optim_sd = get_model_state_dict(model, options=options), None
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if trainable_only:
        # ignore_frozen_params still lets a frozen weight through under a tied alias (lm_head of a model
        # with tied embeddings: the whole vocabulary matrix); keep exactly the trainable parameters.
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        model_sd = {name: value for name, value in model_sd.items() if name in trainable}
    return {"model": model_sd} if optim_sd is None else {"model": model_sd, "optim": optim_sd}


def unwrapped_class(model: torch.nn.Module) -> type:
    """The model's own class (FSDP2 swaps in a subclass that also derives from FSDPModule)."""
    cls = type(model)
    if issubclass(cls, FSDPModule):
        bases = [b for b in cls.__bases__ if b is not FSDPModule]
        if len(bases) != 1:
            raise TypeError(f"cannot find the original class behind {cls.__name__}")
        return bases[0]
    return cls


def export_hf(path: str, model, source_dir: str, adapter=None) -> None:
    """Gather full weights to rank 0 and write a Hugging Face model directory there. Collective.
    `adapter` (`ballast.engine.lora.Adapter`): the weights written are the merged ones, and the
    adapter goes to `<path>/lora_adapter` in PEFT's format."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _rank() == 0:
        os.makedirs(path, exist_ok=True)
        if adapter is not None:
            save_adapter(os.path.join(path, ADAPTER_DIR), full.items(), adapter)
            full = dict(merged_state(full.items(), adapter.scalings))
        cls = unwrapped_class(model)
        with torch.device("meta"):
            fresh = cls(model.config)
        fresh.load_state_dict(full, assign=True, strict=True)
        fresh.tie_weights()
        try:
            fresh.save_pretrained(path)
        except Exception as err:
            raise_if_disk_full(err, path)
            raise
        for name in sorted(os.listdir(source_dir)):
            src = os.path.join(source_dir, name)
            if not os.path.isfile(src) or name in _NOT_COPIED or name.endswith(_WEIGHT_SUFFIXES):
                continue
            if not os.path.exists(os.path.join(path, name)):
                shutil.copy2(src, os.path.join(path, name))
    _barrier()
