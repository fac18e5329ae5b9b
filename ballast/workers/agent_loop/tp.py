"""A rollout call under tensor parallelism: one leader runs the conversations, its TP peers replay.

Every rank of a vLLM TP engine must step in lockstep with the same requests added in the same order,
but request-level rollout adds requests whenever a conversation is ready (after a tool, after a
peer's turn), which differs from rank to rank. So within a TP group:
  1. all ranks all-gather their prompt Batches (tensors and non-tensors) and call arguments on the
     TP group (arguments that differ between ranks raise on every rank);
  2. the group's first rank (the leader) runs every gathered row's agent loop, tools included (tools
     run once, not once per TP rank); its core (`Leading`) broadcasts the requests added since the
     previous engine step before every step;
  3. the other ranks (followers) add exactly those requests to their engine and step with it, until
     the leader broadcasts the finished call (or its failure, which every rank then raises: no rank
     is left waiting in a collective);
  4. every rank keeps its own rows of the result, in order, at its own prompt width.
Seeds are per request, so every rank samples the same tokens; the leader's result is what all
ranks computed. The collectives run on the TP group (gloo), one small broadcast per engine step.
Partial rollouts: only the leader looks for newer weights. When it switches (`resume.ResumingCore`:
interrupt everything, load, re-add the continuations), it leaves the weights it loads with its source
for its followers (`SharedUpdates.share`) and announces their key before loading them; each follower
drops its requests and takes the same weights from its own source, so the whole group changes weights
between the same two engine steps, and the continuations arrive with the next step's requests. The
versions the leader records for each token are then every rank's. The weights themselves never
travel over the TP group: an export's Ray object references, pickled there, would not resolve.
TP groups are runs of consecutive global ranks, the layout vLLM's external_launcher uses.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from ballast.protocol import Batch
from ballast.workers.agent_loop.output import AgentRollout
from ballast.workers.rollout.async_engine import EngineCore, TurnOutput, TurnRequest
from ballast.workers.rollout.base import start_generate_call
from ballast.workers.rollout.prompts import default_position_ids
from ballast.workers.rollout.resume import ResumingCore, WeightUpdates

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")


def tp_group_ranks(world_size: int, tp_size: int) -> list[list[int]]:
    """The TP groups of a world: [[0..tp-1], [tp..2tp-1], ...] (vLLM external_launcher layout)."""
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tensor_model_parallel_size={tp_size} must divide world_size={world_size}")
    return [list(range(start, start + tp_size)) for start in range(0, world_size, tp_size)]


def new_tp_group(tp_size: int) -> dist.ProcessGroup:
    """This rank's TP group (gloo: only pickled prompts and requests travel on it, even on GPUs).
    Collective: every rank of the world must call it, with the same tp_size."""
    mine = None
    for ranks in tp_group_ranks(dist.get_world_size(), tp_size):
        group = dist.new_group(ranks, backend="gloo")
        if dist.get_rank() in ranks:
            mine = group
    return mine


def pad_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                width: int, pad_token_id: int) -> torch.Tensor:
    """Stack (ids, mask, positions) into one (3, rows, width) int64 tensor, left-padding columns. Pure."""
    rows, cols = input_ids.shape
    if cols > width:
        raise ValueError(f"cannot pad prompts of width {cols} down to {width}")
    out = torch.zeros((3, rows, width), dtype=torch.int64)
    out[0].fill_(int(pad_token_id))
    out[0, :, width - cols:] = input_ids
    out[1, :, width - cols:] = attention_mask
    out[2, :, width - cols:] = position_ids
    return out


def _broadcast(obj, src: int, group) -> object:
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


class Leading:
    """The leader's view of its core: every engine step is announced to the followers first, with the
    requests added since the previous one."""

    def __init__(self, inner: EngineCore, leader: int, group):
        self.inner, self.leader, self.group = inner, leader, group
        self._adds: list[tuple[str, TurnRequest]] = []

    def add(self, request_id: str, request: TurnRequest) -> None:
        self.inner.add(request_id, request)
        self._adds.append((request_id, request))

    def step(self) -> list[tuple[str, TurnOutput]]:
        adds, self._adds = self._adds, []
        _broadcast(("step", adds), self.leader, self.group)
        return self.inner.step()

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()

    def abort_all(self) -> None:
        self.inner.abort_all()

    def interrupt(self):
        return self.inner.interrupt()


class SharedUpdates(WeightUpdates, Protocol):
    """A weight source a TP group switches together: the leader `share`s the weights it loads with its
    `takers` followers (returning a small, picklable key), each follower `take`s them by that key."""

    def share(self, weights: object, takers: int) -> object:
        ...

    def take(self, key: object) -> object:
        ...


class LeadingUpdates:
    """The leader's weight source (partial rollouts): a load is announced to the followers first, with
    the key they take the same weights by, so that they load them before the same engine step."""

    def __init__(self, inner: SharedUpdates, leader: int, group):
        self.inner, self.leader, self.group = inner, leader, group

    @property
    def version(self) -> int:
        return self.inner.version

    def newer(self):
        return self.inner.newer()

    def load(self, weights) -> int:
        key = self.inner.share(weights, dist.get_world_size(self.group) - 1)
        _broadcast(("load", key), self.leader, self.group)
        return self.inner.load(weights)


def _gather(prompts: Batch, args: tuple, group, pad_token_id: int) -> tuple[Batch, list[int]]:
    """Every rank's prompts, in rank order, left-padded to a common width; and each rank's row count.
    `args` (the call's sampling, call index and mode) must be the same on every rank."""
    tensors = prompts.tensors
    if "position_ids" not in tensors.keys():
        tensors = tensors.clone(False)
        tensors["position_ids"] = default_position_ids(tensors["attention_mask"])
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (tensors.select(*PROMPT_KEYS).to_dict(), prompts.non_tensors, args), group=group)
    if any(p[2] != args for p in parts):
        raise ValueError(f"the TP ranks' generate calls differ: {[p[2] for p in parts]} (sampling, call index, "
                         "partial rollouts); every rank of a TP group must make the same call")
    width = max(p[0]["input_ids"].shape[1] for p in parts)
    batches = [Batch(dict(zip(PROMPT_KEYS, pad_prompts(t["input_ids"], t["attention_mask"], t["position_ids"],
                                                       width, pad_token_id))), non_tensors=nt)
               for t, nt, _ in parts]
    return Batch.concat(batches), [b.tensors.batch_size[0] for b in batches]


def generate_in_group(runner, prompts: Batch, sampling, call_index, updates) -> AgentRollout:
    """`runner.generate` for this rank's `prompts` within the runner's TP group (module docstring)."""
    backend, group = runner.backend, runner.group
    ranks = dist.get_process_group_ranks(group)
    leader, me = ranks[0], ranks.index(dist.get_rank())
    full, sizes = _gather(prompts, (sampling, call_index, updates is not None), group, backend.pad_token_id)
    if me == 0:
        try:
            call = start_generate_call(backend, full.tensors, sampling, call_index)
            core = Leading(backend.core(call.sampling, resumable=updates is not None), leader, group)
            if updates is not None:
                core = ResumingCore(core, LeadingUpdates(updates, leader, group))
            result = runner.play(call, full, core)
        except BaseException as err:
            _broadcast(("abort", f"{type(err).__name__}: {err}"), leader, group)
            raise
        _broadcast(("done", result), leader, group)
    else:
        try:
            call = start_generate_call(backend, full.tensors, sampling, call_index)  # same checks and numbering
        except ValueError:
            _broadcast(None, leader, group)  # the leader failed the same check: take its abort
            raise
        result = _follow(backend.core(call.sampling, resumable=updates is not None), updates, leader, group)
    offset = sum(sizes[:me])
    return _own_width(result.rows(offset, offset + sizes[me]), prompts.tensors["input_ids"].shape[1])


def _own_width(result: AgentRollout, width: int) -> AgentRollout:
    """This rank's rows with its own prompt width, where the gathered width only added padding."""
    tensors = result.tensors
    drop = tensors["prompts"].shape[1] - width
    if drop <= 0 or tensors["attention_mask"][:, :drop].any():
        return result
    for key in ("prompts", *PROMPT_KEYS):
        tensors[key] = tensors[key][:, drop:]
    return result


def _follow(core: EngineCore, updates: SharedUpdates | None, leader: int, group) -> AgentRollout:
    """Replay the leader's engine steps and weight loads on this rank until the leader's result arrives."""
    while True:
        kind, payload = _broadcast(None, leader, group)
        if kind == "done":
            return payload
        if kind == "abort":
            core.abort_all()
            raise RuntimeError(f"the TP leader (rank {leader}) failed its rollout call: {payload}")
        if kind == "load":  # the leader interrupted its requests and loads the weights shared under this key now
            core.abort_all()
            updates.load(updates.take(payload))
            continue
        for request_id, request in payload:
            core.add(request_id, request)
        core.step()
