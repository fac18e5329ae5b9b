"""One rollout call: every row's agent loop runs concurrently over the request-level engine.

    runner = AgentLoopRunner(backend, spec, group)   # once per worker: tools, loops, template probe
    result = runner.generate(prompts_batch, sampling, call_index, updates)
    result.tensors       # the rollout output contract (see `output.py`)
    result.columns       # per-sample agent columns (agent_name, agent_stop_reason, agent_num_turns, ...)

This is the only way a rollout generates (training and validation; the batched rollout is the
`single_turn_agent` loop). A call numbers itself (`start_generate_call`), and row r's turn t samples
with `request_seed(seed, engine, call, r, t)`; for single-turn rows that is the batched seed of row r,
hence the same tokens. `group`: the rollout's tensor-parallel group (None: no TP), in which the
leader runs the conversations and the other ranks replay its engine steps (`tp.py`). Each call runs
its own event loop (`asyncio.run`) on the calling thread and leaves nothing running: weight sync,
sleep and wake-up happen between calls. `updates` (partial rollouts): newer weights arriving during the call interrupt
the turns in flight, which resume under them (`ballast.workers.rollout.resume`).
"""

from __future__ import annotations

import asyncio
import functools
import numpy as np

from ballast.models import load_tokenizer
from ballast.tools import ToolExecutor, load_tools
from ballast.workers.agent_loop import tp
from ballast.workers.agent_loop.base import (
    AgentContext, AgentLoopOutput, AgentSample, load_agent_loop_config, registered_loops,
)
from ballast.workers.agent_loop.chat import ChatFormat
from ballast.workers.agent_loop.config import AgentLoopSpec
from ballast.workers.agent_loop.output import AgentRollout, assemble, sample_columns
from ballast.workers.rollout.async_engine import AsyncEngine, EngineCore, request_seed
from ballast.workers.rollout.base import GenerateCall, SamplingConfig, start_generate_call, stop_ids_for
from ballast.workers.rollout.resume import ResumingCore, WeightUpdates

SINGLE_TURN = "single_turn_agent"


class AgentLoopRunner:
    def __init__(self, backend, spec: AgentLoopSpec = AgentLoopSpec(), group=None, tokenizer=None):
        self.backend, self.spec, self.group = backend, spec, group
        self._tokenizer, self._chat = tokenizer, None
        mt = spec.multi_turn
        self.tools = load_tools(mt.tool_config_path)
        self.executor = ToolExecutor(self.tools, max_parallel_calls=mt.max_parallel_calls,
                                     max_response_length=mt.max_tool_response_length,
                                     truncate_side=mt.tool_response_truncate_side, timeout_s=mt.tool_timeout_s)
        self.loops = {**registered_loops(), **load_agent_loop_config(spec.agent_loop_config_path)}
        if spec.default_agent_loop not in self.loops:
            raise ValueError(f"default_agent_loop={spec.default_agent_loop!r} is not a registered agent loop "
                             f"({sorted(self.loops)})")
        if mt.enable or spec.default_agent_loop != SINGLE_TURN:  # a template unfit for tool turns stops here
            eos = backend.eos_token_ids[0] if backend.eos_token_ids else self.tokenizer.eos_token_id
            self.chat.probe(self.chat.decode([eos]), self.executor.schemas() or None)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self.spec.tokenizer_path is None:
                raise ValueError("these agent loops render chat messages: AgentLoopSpec.tokenizer_path is needed")
            self._tokenizer = load_tokenizer(self.spec.tokenizer_path)
        return self._tokenizer

    @property
    def chat(self) -> ChatFormat:
        """The chat format, built when a call first runs a loop other than single_turn_agent."""
        if self._chat is None:
            self._chat = ChatFormat(self.tokenizer, chat_template_kwargs=self.spec.chat_template_kwargs,
                                    sanity_mode=self.spec.multi_turn.tokenization_sanity_check_mode)
        return self._chat

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
                 updates: WeightUpdates | None = None) -> AgentRollout:
        """Run every row's conversation; `prompts` is a Batch (tensors: input_ids, attention_mask,
        optional position_ids; non-tensors: raw_prompt, extra_info, agent_name when present). With
        `updates` the output has `rollout_versions`."""
        if self.group is not None:
            return tp.generate_in_group(self, prompts, sampling, call_index, updates)
        call = start_generate_call(self.backend, prompts.tensors, sampling, call_index)
        return self.play(call, prompts, self.make_core(call.sampling, updates))

    def make_core(self, sampling: SamplingConfig, updates: WeightUpdates | None) -> EngineCore:
        """The backend's core for one call, resuming requests under `updates` when given."""
        core = self.backend.core(sampling, resumable=updates is not None)
        return core if updates is None else ResumingCore(core, updates)

    def play(self, call: GenerateCall, prompts, core: EngineCore) -> AgentRollout:
        """The conversations of `call` (its rows are `prompts`) on `core`, assembled."""
        sampling, rows = call.sampling, len(call.token_lists)
        names = self.agent_names(prompts, rows)
        nt = prompts.non_tensors or {}
        seed = sampling.seed if sampling.do_sample else None
        samples = [AgentSample(
            row=i, prompt_ids=call.token_lists[i],
            messages=_messages(nt["raw_prompt"][i]) if "raw_prompt" in nt else None,
            extra_info=nt["extra_info"][i] if "extra_info" in nt and isinstance(nt["extra_info"][i], dict) else {},
            seed=functools.partial(request_seed, seed, self.backend.config.engine_index, call.call_index, i),
        ) for i in range(rows)]
        chat = self.chat if any(name != SINGLE_TURN for name in names) else None
        outputs, steps = asyncio.run(self._run_all(samples, names, sampling, chat, core))
        tensors = assemble(call.input_ids, call.attention_mask, call.position_ids, outputs,
                           pad_token_id=self.backend.pad_token_id, prompt_length=self.spec.prompt_length,
                           response_length=sampling.max_response_length if sampling.pad_to_max_response_length
                           else None, with_log_probs=sampling.calculate_log_probs)
        return AgentRollout(tensors, sample_columns(outputs, names), steps)

    async def _run_all(self, samples: list[AgentSample], names: list[str], sampling: SamplingConfig,
                       chat: ChatFormat | None, core: EngineCore) -> tuple[list[AgentLoopOutput], int]:
        limit = self.spec.max_concurrent_conversations
        slots = asyncio.Semaphore(limit) if limit else None
        async with AsyncEngine(core) as engine:
            ctx = AgentContext(engine, chat, self.executor, self.spec.multi_turn, sampling,
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
