"""Rollout helpers for tests: the one generate path on a bare backend, reference values computed the
slow, obvious way with a Hugging Face model, and rollout outputs built from chosen responses."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict

from ballast.workers.rollout.base import SamplingConfig
from ballast.workers.rollout.hf_backend import apply_sampling_filters


def generate(backend, prompts: TensorDict, sampling: SamplingConfig | None = None,
             call_index: int | None = None) -> TensorDict:
    """`prompts` (left-padded) through the rollout's generate path on `backend`: single-turn agent loops
    over its request-level core, as the rollout worker runs them without TP."""
    from ballast.protocol import Batch
    from ballast.workers.agent_loop import AgentLoopRunner

    return AgentLoopRunner(backend).generate(Batch(prompts), sampling, call_index).tensors


def rollout_output(input_ids: torch.Tensor, attention_mask: torch.Tensor, responses: Sequence[Sequence[int]],
                   log_probs: Sequence[Sequence[float]] | None = None, *, pad_token_id: int,
                   stop_token_ids: Sequence[int] = (), response_length: int | None = None) -> TensorDict:
    """What a rollout returns for these left-padded prompts had the engine sampled `responses` (each cut
    after its first stop id, as the engine's core cuts it): the single-turn conversations assembled by
    the agent loops' own builder."""
    from ballast.workers.agent_loop import StopReason, Transcript
    from ballast.workers.agent_loop.output import assemble
    from ballast.workers.rollout.async_engine import finish
    from ballast.workers.rollout.prompts import read_prompts

    ids, mask, positions, prompts = read_prompts({"input_ids": input_ids, "attention_mask": attention_mask})
    outputs = []
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        turn = finish(response, None if log_probs is None else log_probs[i], stop_token_ids, max(len(response), 1))
        t = Transcript(prompt, with_log_probs=log_probs is not None)
        t.add_sampled(turn.token_ids, turn.log_probs)
        outputs.append(t.output(StopReason.ANSWER if turn.finish_reason == "stop" else StopReason.LENGTH, 2))
    return assemble(ids, mask, positions, outputs, pad_token_id=pad_token_id, prompt_length=None,
                    response_length=response_length, with_log_probs=log_probs is not None)


def filtered_log_probs(model, out: TensorDict, row: int, prompt_len: int, sampling: SamplingConfig) -> torch.Tensor:
    """The log-prob of each response token of `out` row `row` under the distribution it was drawn
    from (temperature, top-k and top-p applied), from one teacher-forced pass over its real tokens."""
    seq = out["input_ids"][row][out["attention_mask"][row].bool()]
    with torch.no_grad():
        logits = model(seq[None], use_cache=False).logits[0, prompt_len - 1:-1]
    filtered = apply_sampling_filters(logits, sampling)
    return torch.log_softmax(filtered, -1).gather(1, seq[prompt_len:, None])[:, 0]
