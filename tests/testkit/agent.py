"""Test doubles for agent-loop tests: scripted engines that answer with chosen text, and a fake core.

`ScriptedEngine` stands in for `AsyncEngine`: each request gets the next scripted reply for its
conversation (found by the prompt's first tokens), tokenised with a deliberately NON-canonical
split where asked (to prove the loop keeps sampled ids as they are), with made-up log-probs it
remembers, so a test can check that the training sequence holds exactly what was "sampled".
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ballast.workers.agent_loop import AgentContext, AgentLoop, ChatFormat, MultiTurnConfig, StopReason, Transcript
from ballast.workers.rollout.async_engine import TurnOutput, TurnRequest
from ballast.workers.rollout.base import SamplingConfig
from ballast.tools import ToolExecutor
from ballast.tools.calculator import CalculatorTool


def char_split_ids(tokenizer, text: str) -> list[int]:
    """`text` tokenised one character at a time: valid ids, but not the tokenizer's own split."""
    ids = []
    for ch in text:
        ids.extend(tokenizer.encode(ch, add_special_tokens=False))
    return ids


@dataclass
class ScriptedEngine:
    """Replies per conversation: `scripts[key]` is a list of reply texts; the key is `key_of(prompt)`."""

    tokenizer: object
    scripts: dict
    key_of: object
    eos_id: int
    non_canonical: bool = False
    delay_s: float = 0.0
    calls: list = field(default_factory=list)        # (request, output) in arrival order
    sampled: dict = field(default_factory=dict)      # key -> list of (ids, log_probs) per turn

    async def generate(self, request: TurnRequest) -> TurnOutput:
        key = self.key_of(request.prompt_ids)
        turn = len(self.sampled.setdefault(key, []))
        text = self.scripts[key][turn]
        ids = char_split_ids(self.tokenizer, text) if self.non_canonical else self.tokenizer.encode(
            text, add_special_tokens=False)
        ids = ids + [self.eos_id]
        reason = "stop"
        if len(ids) > request.max_tokens:
            ids, reason = ids[: request.max_tokens], "length"
        lps = tuple(-0.01 * (i + 1) - 0.001 * turn for i in range(len(ids)))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        out = TurnOutput(tuple(ids), lps, reason)
        self.sampled[key].append((list(ids), list(lps)))
        self.calls.append((request, out))
        return out


def make_context(engine, tokenizer, tools=None, *, response_length=512, prompt_length=256,
                 sanity_mode="strict", **multi_turn) -> AgentContext:
    mt = MultiTurnConfig(enable=True, tokenization_sanity_check_mode=sanity_mode, **multi_turn)
    executor = ToolExecutor(tools or {}, max_parallel_calls=mt.max_parallel_calls,
                            max_response_length=mt.max_tool_response_length,
                            truncate_side=mt.tool_response_truncate_side, timeout_s=mt.tool_timeout_s)
    sampling = SamplingConfig(max_response_length=response_length, calculate_log_probs=True, seed=0)
    return AgentContext(engine, ChatFormat(tokenizer, sanity_mode=sanity_mode), executor, mt, sampling,
                        prompt_length, response_length)


class FakeCore:
    """An `EngineCore` that finishes each request after `steps_of(request)` steps with `reply(request)`
    tokens; records the order of adds and steps. `fail_at_step` makes a step raise."""

    def __init__(self, reply=lambda r: (7, 8), steps_of=lambda r: 1, fail_at_step=None):
        self.reply, self.steps_of, self.fail_at_step = reply, steps_of, fail_at_step
        self.live: dict = {}
        self.log: list = []
        self.step_count = 0

    def add(self, request_id, request):
        self.live[request_id] = [request, self.steps_of(request)]
        self.log.append(("add", request_id))

    def step(self):
        self.step_count += 1
        self.log.append(("step", len(self.live)))
        if self.fail_at_step is not None and self.step_count >= self.fail_at_step:
            raise RuntimeError("engine exploded")
        done = []
        for rid in list(self.live):
            self.live[rid][1] -= 1
            if self.live[rid][1] <= 0:
                request = self.live.pop(rid)[0]
                tokens = tuple(self.reply(request))[: request.max_tokens]
                done.append((rid, TurnOutput(tokens, tuple(0.0 for _ in tokens), "stop")))
        return done

    def has_unfinished(self):
        return bool(self.live)

    def abort_all(self):
        self.live.clear()


INSERTED = (5, 6, 7, 8, 9)


class InsertingLoop(AgentLoop):
    """A multi-turn loop for real engines (random models never call tools): three sampled turns of at
    most 6 tokens with INSERTED ids (mask 0) between them, each inserted turn after `wait_s` seconds."""

    wait_s = 0.0

    async def run(self, sample):
        t = Transcript(sample.prompt_ids, with_log_probs=self.ctx.sampling.calculate_log_probs)
        for turn in range(3):
            if turn:
                if self.wait_s:
                    await asyncio.sleep(self.wait_s)
                t.add_inserted(INSERTED)
            out = await self.ctx.engine.generate(TurnRequest(t.ids, 6, sample.seed(turn)))
            t.add_sampled(out.token_ids, out.log_probs, out.versions)
        return t.output(StopReason.ANSWER, num_turns=5, info={"assistant_turns": 3.0})


def register_inserting_loop():
    """Register `InsertingLoop` as "test_inserting_agent"."""
    from ballast.workers.agent_loop import register

    return register("test_inserting_agent")(InsertingLoop)


WAIT_S = 1.0


class WaitingLoop(InsertingLoop):
    """`InsertingLoop` pausing WAIT_S before each inserted turn, standing in for a slow tool
    (`agent_loop_config_path`: `_target_: testkit.agent.WaitingLoop`). A generation call then lasts
    ~2 x WAIT_S whatever the model, so a trainer update lands while its conversations are in flight
    (partial rollouts)."""

    wait_s = WAIT_S


class SlowCalculatorTool(CalculatorTool):
    """The calculator, answering after `config.delay_s` seconds (default WAIT_S): a slow tool for real
    tool-agent runs (with `build_tool_calling_model`) in which a trainer update must land while the
    conversations are in flight (partial rollouts; scripts/gpu_smoke.sh)."""

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        await asyncio.sleep(float(self.config.get("delay_s", WAIT_S)))
        return await super().execute(instance_id, parameters, **kwargs)


# The one reply of `build_tool_calling_model`: a well-formed hermes call of the calculator tool.
CALCULATOR_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


def build_tool_calling_model(out_dir, *, margin: float = 30.0) -> str:
    """The tiny model (and tokenizer) rewired to answer every generation prompt with CALCULATOR_CALL, then
    its stop token, with any sampling settings: real tool turns through the whole driver loop (random
    models never call tools). The tokenizer gets the call as one added token; the layers' output
    projections are zeroed, so the last hidden state is the current token's embedding, and the untied
    output head maps the generation prompt's last token ("\\n") to the call and the call to the stop
    token, `margin` logits above every other token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ballast.models import tiny_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)
    newline, = tokenizer.encode("\n", add_special_tokens=False)
    tokenizer.add_tokens([CALCULATOR_CALL])
    call = tokenizer.convert_tokens_to_ids(CALCULATOR_CALL)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[call] = torch.randn(embed.shape[1], generator=torch.Generator().manual_seed(0)) * embed.std()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros_like(embed)
        scale = margin / embed.shape[1] ** 0.5  # the normed hidden state has norm sqrt(hidden_size)
        head[call] = scale * embed[newline] / embed[newline].norm()
        head[tokenizer.eos_token_id] = scale * embed[call] / embed[call].norm()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return str(out_dir)
