"""Weight sync: stream the actor's current weights into the rollout engine, one bucket of full tensors at a time.

The actor (FSDP2) yields (Hugging Face name, full tensor) pairs, gathered a bucket of parameters per
collective, so every rank iterates in the same order and only one bucket is materialised at a time.
Under rollout TP every rank feeds the same full tensors and vLLM keeps its own shard of each. How each
backend loads them, and the colocated sleep / sync / wake sequence (`weight_sources.ColocatedActorWeights`),
are in docs/rollout.md.

LoRA (`sync_actor`): when the actor trains an adapter and the backend serves adapters, only the
adapter's tensors move (`SyncMode.ADAPTER`; the engine keeps the base weights it loaded, and gets them
again only after a level-2 sleep discarded them); otherwise the actor's merged weights are loaded like
full weights (`SyncMode.MERGED`). `load_adapter` wakes the weights first too: vLLM's LoRA buffers sleep
with them, and a wake-up after the install would restore the previous adapter over the new one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from enum import Enum

import torch

from ballast.engine.gather import iter_gathered

from .base import RolloutBackend


def load_weights(backend: RolloutBackend, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Stream (name, full tensor) pairs into `backend`; returns how many were loaded.

    Under TP or with an FSDP source this is collective: call it on every rank with the same order.
    """
    return backend.load_weights(named_tensors)


def iter_full_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every entry of `module.state_dict()`, gathering DTensor shards (in
    buckets, one collective each; see `ballast.engine.gather`).

    For an FSDP2 (`fully_shard`) model this is collective: every rank must consume the iterator
    to the end, in lockstep. Plain tensors are yielded as they are (detached).
    """
    yield from iter_gathered(module.state_dict().items())


class SyncMode(str, Enum):
    """What a weight sync moves into the rollout engine."""

    FULL = "full"        # every weight (no adapter)
    ADAPTER = "adapter"  # the LoRA adapter only; the engine serves it next to its base weights
    MERGED = "merged"    # the LoRA adapter merged into the weights, loaded as full weights

    def __str__(self) -> str:
        return self.value


def sync_mode(has_adapter: bool, backend: RolloutBackend) -> SyncMode:
    if not has_adapter:
        return SyncMode.FULL
    return SyncMode.ADAPTER if backend.serves_adapters else SyncMode.MERGED


def sync_actor(backend: RolloutBackend, engine, mode: SyncMode, layered: bool = False) -> int:
    """Move the actor engine's current weights into `backend` as `mode` says; returns the tensor count.
    Collective over the actor's mesh (the gathers) and, under rollout TP, the TP group."""
    if mode is SyncMode.ADAPTER:
        if backend.needs_weights:  # a level-2 sleep dropped the base weights too
            backend.load_weights(engine.iter_base_state_dict(layered))
        return backend.load_adapter(engine.iter_adapter_state_dict(layered), engine.adapter.config_dict())
    return backend.load_weights(engine.iter_full_state_dict(layered=True) if layered else engine.iter_full_state_dict())
