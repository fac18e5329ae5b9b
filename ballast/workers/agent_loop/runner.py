"""One rollout call in async mode: every row's agent loop runs concurrently over the async engine.

    runner = AgentLoopRunner(backend, spec)        # once per worker: tokenizer, tools, loops, template probe
    result = runner.generate(prompts_batch, sampling, call_index)
    result.tensors       # the rollout output contract (see `output.py`)
    result.columns       # per-sample agent columns (agent_name, agent_stop_reason, agent_num_turns, ...)

The call takes the same arguments as the batched `generate` and numbers itself the same way
(`start_generate_call`), and row r's turn t samples with `request_seed(seed, engine, call, r, t)`;
for single-turn rows that is the batched seed of row r, hence the same tokens. Each call runs its
own event loop (`asyncio.run`) on the calling thread and its own engine thread, so nothing is left
running between calls: weight sync, sleep and wake-up happen between calls as in batched mode.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

import numpy as np
from tensordict import TensorDict

from ballast.models import load_tokenizer
from ballast.tools import ToolExecutor, load_tools
from ballast.workers.agent_loop.base import (
    AgentContext, AgentLoopOutput, AgentSample, load_agent_loop_config, registered_loops,
)
from ballast.workers.agent_loop.chat import ChatFormat
from ballast.workers.agent_loop.config import AgentLoopSpec
from ballast.workers.agent_loop.output import assemble, sample_columns
from ballast.workers.rollout.async_engine import AsyncEngine, StepHook, make_core, request_seed
from ballast.workers.rollout.base import SamplingConfig, start_generate_call, stop_ids_for
from ballast.workers.rollout.resume import ResumingCore, WeightUpdates

SINGLE_TURN = "single_turn_agent"


@dataclass
class AgentRollout:
    tensors: TensorDict
    columns: dict[str, np.ndarray]
    engine_steps: int


class AgentLoopRunner:
    def __init__(self, backend, spec: AgentLoopSpec, tokenizer=None):
        self.backend, self.spec = backend, spec
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec.tokenizer_path)
        mt = spec.multi_turn
        self.tools = load_tools(mt.tool_config_path)
        self.executor = ToolExecutor(self.tools, max_parallel_calls=mt.max_parallel_calls,
                                     max_response_length=mt.max_tool_response_length,
                                     truncate_side=mt.tool_response_truncate_side, timeout_s=mt.tool_timeout_s)
        self.loops = {**registered_loops(), **load_agent_loop_config(spec.agent_loop_config_path)}
        if spec.default_agent_loop not in self.loops:
            raise ValueError(f"default_agent_loop={spec.default_agent_loop!r} is not a registered agent loop "
                             f"({sorted(self.loops)})")
        self.chat = ChatFormat(self.tokenizer, chat_template_kwargs=spec.chat_template_kwargs,
                               sanity_mode=mt.tokenization_sanity_check_mode)
        if mt.enable or spec.default_agent_loop != SINGLE_TURN:
            eos = backend.eos_token_ids[0] if backend.eos_token_ids else self.tokenizer.eos_token_id
            self.chat.probe(self.chat.decode([eos]), self.executor.schemas() or None)

    def agent_names(self, prompts, rows: int) -> list[str]:
        """Each row's loop: the `agent_name` column where set, else the default; unknown names raise."""
        column = prompts.non_tensors.get("agent_name") if prompts.non_tensors else None
        names = []
        for i in range(rows):
            name = column[i] if column is not None else None
            name = name if isinstance(name, str) and name else self.spec.default_agent_loop
            if name not in self.loops:
                raise ValueError(f"prompt row {i}: agent_name={name!r} is not a registered agent loop "
                                 f"({sorted(self.loops)})")
            names.append(name)
        return names

    def generate(self, prompts, sampling: SamplingConfig | None = None, call_index: int | None = None,
                 on_step: StepHook | None = None, updates: WeightUpdates | None = None) -> AgentRollout:
        """Run every row's conversation; `prompts` is a Batch (tensors: input_ids, attention_mask,
        position_ids; non-tensors: raw_prompt, extra_info, agent_name when present). `updates`: partial
        rollouts, weights that arrive during the call interrupt and resume the turns in flight (see
        `ballast.workers.rollout.resume`); the output then has `rollout_versions`."""
        call = start_generate_call(self.backend, prompts.tensors, sampling, call_index)
        sampling = call.sampling
        rows = len(call.token_lists)
        names = self.agent_names(prompts, rows)
        nt = prompts.non_tensors or {}
        seed = sampling.seed if sampling.do_sample else None
        samples = [AgentSample(
            row=i, prompt_ids=call.token_lists[i],
            messages=_messages(nt["raw_prompt"][i]) if "raw_prompt" in nt else None,
            extra_info=nt["extra_info"][i] if "extra_info" in nt and isinstance(nt["extra_info"][i], dict) else {},
            seed=functools.partial(request_seed, seed, self.backend.config.engine_index, call.call_index, i),
        ) for i in range(rows)]
        outputs, steps = asyncio.run(self._run_all(samples, names, sampling, on_step, updates))
        tensors = assemble(call.input_ids, call.attention_mask, call.position_ids, outputs,
                           pad_token_id=self.backend.pad_token_id, prompt_length=self.spec.prompt_length,
                           response_length=sampling.max_response_length if sampling.pad_to_max_response_length
                           else None, with_log_probs=sampling.calculate_log_probs)
        return AgentRollout(tensors, sample_columns(outputs, names), steps)

    async def _run_all(self, samples: list[AgentSample], names: list[str], sampling: SamplingConfig,
                       on_step: StepHook | None, updates: WeightUpdates | None) -> tuple[list[AgentLoopOutput], int]:
        core = make_core(self.backend, sampling, resumable=updates is not None)
        if updates is not None:
            core = ResumingCore(core, updates)
        limit = self.spec.max_concurrent_conversations
        slots = asyncio.Semaphore(limit) if limit else None
        async with AsyncEngine(core, on_step) as engine:
            ctx = AgentContext(engine, self.chat, self.executor, self.spec.multi_turn, sampling,
                               self.spec.prompt_length, sampling.max_response_length,
                               stop_ids_for(sampling, self.backend.eos_token_ids))
            loops = {name: self.loops[name](ctx) for name in sorted(set(names))}

            async def play(sample: AgentSample, name: str) -> AgentLoopOutput:
                if slots is None:
                    return await loops[name].run(sample)
                async with slots:
                    return await loops[name].run(sample)

            tasks = [asyncio.ensure_future(play(s, n)) for s, n in zip(samples, names)]
            try:
                outputs = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise
        return list(outputs), engine.steps


def _messages(raw) -> list[dict] | None:
    """Chat messages from a `raw_prompt` cell (a list of dicts, or a numpy array of them)."""
    if raw is None:
        return None
    if isinstance(raw, np.ndarray):
        raw = raw.tolist()
    return [dict(m) for m in raw]
