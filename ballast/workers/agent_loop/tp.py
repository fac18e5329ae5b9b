"""Async rollout under tensor parallelism: one leader runs the conversations, its TP peers replay.

Every rank of a vLLM TP engine must call `step()` in lockstep with the same requests added in the
same order, but request-level rollout adds requests whenever a conversation is ready (after a tool,
after a peer's turn), which differs from rank to rank. So within a TP group:
  1. all ranks all-gather their prompt Batches (tensors and non-tensors) on the TP group;
  2. the group's first rank (the leader) runs every gathered row's agent loop, tools included (tools
     run once, not once per TP rank); before each engine step its engine thread broadcasts the
     requests added since the previous step;
  3. the other ranks (followers) add exactly those requests to their engine and step with it, until
     the leader broadcasts the finished call (or its failure, which every rank then raises: no rank
     is left waiting in a collective);
  4. every rank keeps its own rows of the result, in order.
Seeds are per request, so every rank samples the same tokens; the leader's result is what all
ranks computed. The collectives run on the TP group (gloo), one small broadcast per engine step.
"""

from __future__ import annotations

import torch.distributed as dist

from ballast.protocol import Batch
from ballast.workers.agent_loop.runner import AgentLoopRunner, AgentRollout
from ballast.workers.rollout.async_engine import make_core
from ballast.workers.rollout.base import SamplingConfig, start_generate_call
from ballast.workers.rollout.tp import pad_prompts

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")


def _broadcast(obj, src: int, group) -> object:
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _gather_prompts(prompts: Batch, group, pad_token_id: int) -> tuple[Batch, list[int]]:
    """Every rank's prompts, in rank order, left-padded to a common width; and each rank's row count."""
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (prompts.tensors.select(*PROMPT_KEYS).to_dict(), prompts.non_tensors), group=group)
    width = max(p[0]["input_ids"].shape[1] for p in parts)
    batches = []
    for tensors, non_tensors in parts:
        rows = tensors["input_ids"].shape[0]
        stack = pad_prompts(tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"], rows, width,
                            pad_token_id)
        batches.append(Batch(dict(zip(PROMPT_KEYS, stack)), non_tensors=non_tensors))
    return Batch.concat(batches), [b.tensors.batch_size[0] for b in batches]


def tp_agent_generate(runner: AgentLoopRunner, prompts: Batch, group, sampling: SamplingConfig | None = None,
                      call_index: int | None = None, updates=None) -> AgentRollout:
    """`runner.generate` for this rank's `prompts` within TP `group` (None: no TP, run it directly).
    `updates` (partial rollouts) is only taken without TP: the start-up rules refuse it with TP."""
    if group is None:
        return runner.generate(prompts, sampling, call_index, updates=updates)
    if updates is not None:
        raise ValueError("partial rollouts need actor_rollout_ref.rollout.tensor_model_parallel_size=1")
    if "position_ids" not in prompts.tensor_keys:
        from ballast.workers.rollout.postprocess import default_position_ids

        prompts = Batch({**{k: prompts[k] for k in prompts.tensor_keys},
                         "position_ids": default_position_ids(prompts["attention_mask"])},
                        non_tensors=prompts.non_tensors)
    backend = runner.backend
    ranks = dist.get_process_group_ranks(group)
    leader, me = ranks[0], dist.get_rank()
    full, sizes = _gather_prompts(prompts, group, backend.pad_token_id)
    offset = sum(sizes[: ranks.index(me)])
    if me == leader:
        try:
            result = runner.generate(full, sampling, call_index,
                                     on_step=lambda adds: _broadcast(("step", adds), leader, group))
        except BaseException as err:
            _broadcast(("abort", f"{type(err).__name__}: {err}"), leader, group)
            raise
        _broadcast(("done", result), leader, group)
    else:
        result = _follow(backend, full, sampling, call_index, leader, group)
    rows = slice(offset, offset + sizes[ranks.index(me)])
    return AgentRollout(result.tensors[rows].clone(), {k: v[rows] for k, v in result.columns.items()},
                        result.engine_steps)


def _follow(backend, full: Batch, sampling: SamplingConfig | None, call_index: int | None, leader: int,
            group) -> AgentRollout:
    """Replay the leader's engine steps on this rank's engine until the leader's result arrives."""
    call = start_generate_call(backend, full.tensors, sampling, call_index)  # same checks and numbering
    core = make_core(backend, call.sampling)
    while True:
        kind, payload = _broadcast(None, leader, group)
        if kind == "done":
            return payload
        if kind == "abort":
            core.abort_all()
            raise RuntimeError(f"the TP leader (rank {leader}) failed its async rollout: {payload}")
        for request_id, request in payload:
            core.add(request_id, request)
        if core.has_unfinished():
            core.step()

