"""A pipeline engine's checkpoints and HF export.

A checkpoint has the layout of the engine's usual one (`ballast.engine.checkpoint`: ``dcp/`` with the
weights and optimizer state under the model's own parameter names, each rank writing its stages, and
``engine_state.pt`` with the schedule and counters) plus ``pipeline.json``, the layout it was saved
with: pipeline ranks, virtual stages and every stage's layers. The optimizer state is saved
flattened, one key per parameter (``flatten_optimizer_state_dict``): unflattened, DCP keys the
optimizer's parameter groups by their index, and the pipeline ranks, which hold different
parameters, would overwrite each other's groups (measured: a resumed first stage lost its learning
rate). A resume needs the same layout; any other (another pp size, another split, or a checkpoint
without pipeline parallelism) is refused naming both, since each rank's optimizer state belongs to
the stages it held. An HF export gathers every stage's weights into one plain model directory, from
which a run can start under any layout (weights only).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict

from ballast.balance import PipelineShape
from ballast.engine import checkpoint as ckpt
from ballast.engine.pipeline.stages import StagePlacement
from ballast.engine.safe_load import load_dcp, load_torch_file

LAYOUT_FILE = ckpt.PIPELINE_LAYOUT_FILE
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model, optimizer) -> dict:
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=_OPTIONS)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(path: str, model, optimizer, scheduler, counters: dict, shape: PipelineShape,
                    placement: StagePlacement) -> None:
    """Every rank's stages (DCP), the schedule and counters, and the layout. Collective."""
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    try:
        dcp.save(_state(model, optimizer), checkpoint_id=os.path.join(path, ckpt.DCP_DIR))
        if dist.get_rank() == 0:
            torch.save({"scheduler": scheduler.state_dict() if scheduler is not None else None,
                        "counters": dict(counters), "adapter": None}, os.path.join(path, ckpt.ENGINE_STATE_FILE))
            with open(os.path.join(path, LAYOUT_FILE), "w") as f:
                json.dump(layout_record(shape, placement), f)
    except Exception as err:
        ckpt.raise_if_disk_full(err, path)
        raise
    dist.barrier()


def load_checkpoint(path: str, model, optimizer, scheduler, shape: PipelineShape, placement: StagePlacement) -> dict:
    """Restore what `save_checkpoint` wrote under the same layout (else ValueError, before any
    read); returns the counters. Files are read as the engine's own checkpoints are, through loaders
    that let no file run code (`ballast.engine.safe_load`). Collective."""
    check_layout(path, shape, placement)
    extra = load_torch_file(os.path.join(path, ckpt.ENGINE_STATE_FILE))
    if extra.get("adapter") is not None:
        raise ValueError(f"checkpoint {path!r} holds a LoRA adapter; a pipeline engine trains full weights")
    state = _state(model, optimizer)
    load_dcp(state, os.path.join(path, ckpt.DCP_DIR))
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}), options=_OPTIONS)
    if scheduler is not None:
        if extra["scheduler"] is None:
            raise ValueError(f"checkpoint {path!r} has no scheduler state but this engine has a scheduler")
        scheduler.load_state_dict(extra["scheduler"])
    return dict(extra["counters"])


def layout_record(shape: PipelineShape, placement: StagePlacement) -> dict:
    return {"pipeline_model_parallel_size": shape.pp_size, "virtual_pipeline_model_parallel_size": shape.virtual_stages,
            "stage_layers": [list(b) for b in placement.bounds]}


def check_layout(path: str, shape: PipelineShape, placement: StagePlacement) -> None:
    """Raise ValueError unless the checkpoint at ``path`` was saved with this pipeline layout."""
    if not os.path.isdir(os.path.join(path, ckpt.DCP_DIR)) or not os.path.isfile(os.path.join(path, ckpt.ENGINE_STATE_FILE)):
        raise ValueError(f"{path!r} is not an engine checkpoint (expected {ckpt.DCP_DIR}/ and {ckpt.ENGINE_STATE_FILE})")
    refusal = ckpt.pipeline_layout_refusal(path, layout_record(shape, placement))
    if refusal is not None:
        raise ValueError(refusal)


def export_hf(path: str, full_state, model_class, local_model, source_dir: str) -> None:
    """Gather ``full_state`` ((name, tensor) of every weight, a collective iterator) and write the
    whole model from rank 0 through `ballast.engine.checkpoint.export_hf`. Collective."""
    full = {}
    for name, tensor in full_state:
        if dist.get_rank() == 0:
            full[name] = tensor.detach().to("cpu", copy=True)
    model = local_model
    if dist.get_rank() == 0:
        with torch.device("meta"):
            model = model_class(local_model.config)
        model.load_state_dict(full, assign=True, strict=True)
        model.tie_weights()
    ckpt.export_hf(path, model, source_dir)
