"""A Hugging Face decoder-only model cut into pipeline stages.

Stage ``s`` holds a contiguous range of decoder layers (sizes from the FLOPs model,
:func:`ballast.balance.pipeline_cost.balanced_stage_layers`); the first stage also holds the token
embedding, the last the final norm and the output head (the LM head, or a critic's value head).
Stage ``s`` lives on pipeline rank ``s % pp`` (v stages per rank with virtual stages).

Each rank keeps the Hugging Face module itself, pruned in place to what its stages hold (the layers
it does not run are dropped, ``embed_tokens`` / ``norm`` / the head set to None where another rank
has them), so its ``state_dict`` names are the model's own: checkpoints, weight sync and export need
no renaming. A :class:`StageModule` is the view of one stage that the schedule runs.

With tied embeddings (SmolLM2) the first and the last stage each hold a copy of the vocabulary
matrix (the embedding's and the head's); `ballast.engine.pipeline.weights` keeps them equal by
summing their gradients before every step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from ballast.engine.attention import CONTEXT_KWARG
from ballast.engine.logprob import log_probs_and_entropy
from ballast.engine.pipeline.slots import Slot

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class StageModule(nn.Module):
    """One stage: ``[embed] + layers + [norm + head]``. ``forward(x, slot)``: x is the slot's token
    ids (first stage) or the previous stage's (1, T, hidden) activations; returns (1, T, hidden), or
    on the last stage (rows, T) per-position outputs (log-probs and entropy, or values) that are
    zero except at the slot's kept positions. Computes on the slot's real tokens only and pads back."""

    def __init__(self, embed: nn.Module | None, layers: dict[int, nn.Module], norm: nn.Module | None,
                 head: nn.Module | None, rotary: nn.Module, is_critic: bool) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleDict({str(i): layer for i, layer in sorted(layers.items())})
        self.norm = norm
        self.head = head
        self.rotary_emb = rotary
        self.is_critic = is_critic

    def forward(self, x: torch.Tensor, slot: Slot) -> torch.Tensor:
        n, total = slot.num_tokens, slot.slot_tokens
        hidden = self.embed_tokens(x[:, :n]) if self.embed_tokens is not None else x[:, :n]
        positions = slot.position_ids[:, :n]
        rotary = self.rotary_emb(hidden, positions)
        for layer in self.layers.values():
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary,
                           use_cache=False, **{CONTEXT_KWARG: slot.attention})
        if self.head is None:
            return F.pad(hidden, (0, 0, 0, total - n))
        return self._head_outputs(self.norm(hidden), slot, total)

    def _head_outputs(self, hidden: torch.Tensor, slot: Slot, total: int) -> torch.Tensor:
        head = slot.head
        out = hidden.new_zeros((head.output_rows, total), dtype=torch.float32)
        keep = slot.keep
        if not keep.numel():
            return out + hidden.sum() * 0.0  # an empty micro-batch: zero, still on the graph
        picked = self.head(hidden[:, keep])
        if head.is_critic:
            return out.index_put((torch.zeros_like(keep), keep), picked[0, :, 0].float())
        log_probs, entropy = log_probs_and_entropy(picked.reshape(-1, picked.shape[-1]), slot.labels,
                                                   head.temperature, head.calculate_entropy, head.chunk_tokens)
        out = out.index_put((torch.zeros_like(keep), keep), log_probs)
        if entropy is not None:
            out = out.index_put((torch.ones_like(keep), keep), entropy)
        return out


@dataclass(frozen=True)
class StagePlacement:
    """Where every decoder layer and every weight of the model lives."""

    bounds: tuple[tuple[int, int], ...]  # [start, end) layers of each stage
    pp_size: int

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    def stage_of(self, name: str) -> int:
        """The stage holding parameter (or buffer) ``name`` of the unpruned model."""
        match = _LAYER.match(name)
        if match:
            layer = int(match.group(1))
            return next(s for s, (a, b) in enumerate(self.bounds) if a <= layer < b)
        if name.startswith("model.embed_tokens."):
            return 0
        if name.startswith(("model.norm.", "lm_head.", "score.")):
            return self.num_stages - 1
        if name.startswith("model.rotary_emb."):
            return -1  # every stage has one
        raise ValueError(f"cannot place {name!r} on a pipeline stage: pipeline parallelism supports decoder-only "
                         "models laid out as model.embed_tokens, model.layers, model.norm and a head (Llama, Qwen2)")

    def rank_of(self, name: str) -> int:
        stage = self.stage_of(name)
        return stage % self.pp_size

    def local_stages(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if s % self.pp_size == pp_rank]


def _head(model: PreTrainedModel, is_critic: bool) -> nn.Module:
    head = getattr(model, "score" if is_critic else "lm_head", None)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no {'score' if is_critic else 'lm_head'} module to place on "
                         "the last pipeline stage")
    return head


def _base(model: PreTrainedModel) -> nn.Module:
    base = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if base is None or getattr(base, attr, None) is None:
            raise ValueError(f"{type(model).__name__} is not laid out as model.embed_tokens / layers / norm / "
                             f"rotary_emb (missing {attr}): pipeline parallelism supports Llama- and Qwen2-style "
                             "decoder-only models")
    return base


def split_model(model: PreTrainedModel, placement: StagePlacement, pp_rank: int, is_critic: bool) -> list[StageModule]:
    """This rank's stage modules (in stage order) over ``model``, which is pruned in place to them."""
    base = _base(model)
    head = _head(model, is_critic)
    layers = list(base.layers)
    if len(layers) != placement.bounds[-1][1]:
        raise ValueError(f"the stage split covers {placement.bounds[-1][1]} layers, the model has {len(layers)}")
    last = placement.num_stages - 1
    stages = []
    for s in placement.local_stages(pp_rank):
        a, b = placement.bounds[s]
        stages.append(StageModule(base.embed_tokens if s == 0 else None, {i: layers[i] for i in range(a, b)},
                                  base.norm if s == last else None, head if s == last else None, base.rotary_emb,
                                  is_critic))
    local = placement.local_stages(pp_rank)
    owned = {i for s in local for i in range(*placement.bounds[s])}
    base.layers = nn.ModuleDict({str(i): layers[i] for i in sorted(owned)})
    if 0 not in local:
        base.embed_tokens = None
    if last not in local:
        base.norm = None
        setattr(model, "score" if is_critic else "lm_head", None)
    return stages
