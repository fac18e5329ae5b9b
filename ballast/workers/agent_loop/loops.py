"""The shipped agent loops: `single_turn_agent` (one sampled answer) and `tool_agent` (hermes tool calls).

`tool_agent` plays a conversation turn by turn:

    prompt = template(messages, tools=schemas, generation prompt)
    repeat: sample a turn (at most what is left of response_length)
            -> ended on the budget: stop "length"
            -> no tool call in it: stop "answer"
            -> max_assistant_turns / max_user_turns reached: stop with that reason
            -> run the calls (executor: time limit, bounded parallelism, truncation), append the
               template's tool messages + next generation prompt as inserted tokens (mask 0);
               if they would not leave room for a reply: stop "length" without them
    then the tokenisation sanity check (see `chat.py`).
Every tool failure (unknown tool, malformed call, invalid arguments, exception, timeout) becomes the
tool message the model reads next, and is counted in the sample's info.
"""

from __future__ import annotations

import logging

from ballast.workers.agent_loop.base import (
    AgentLoop, AgentLoopOutput, AgentSample, StopReason, Transcript, register,
)
from ballast.workers.agent_loop.hermes import parse_hermes
from ballast.workers.rollout.async_engine import TurnRequest

logger = logging.getLogger(__name__)


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoop):
    """The dataset's prompt ids, one sampled response: what batched generation produces."""

    async def run(self, sample: AgentSample) -> AgentLoopOutput:
        ctx = self.ctx
        t = Transcript(sample.prompt_ids, with_log_probs=ctx.sampling.calculate_log_probs)
        out = await ctx.engine.generate(TurnRequest(sample.prompt_ids, ctx.response_length, sample.seed(0)))
        t.add_sampled(out.token_ids, out.log_probs, out.versions)
        reason = StopReason.ANSWER if out.finish_reason == "stop" else StopReason.LENGTH
        return t.output(reason, num_turns=2, info={"assistant_turns": 1.0})


_COUNTERS = ("tool_calls", "tool_errors", "tool_timeouts", "malformed_tool_calls", "unknown_tool_calls",
             "tool_calls_dropped", "tool_latency_s", "tool_latency_max_s")


@register("tool_agent")
class ToolAgentLoop(AgentLoop):
    async def run(self, sample: AgentSample) -> AgentLoopOutput:
        ctx, chat = self.ctx, self.ctx.chat
        if sample.messages is None:
            raise ValueError(f"row {sample.row}: tool_agent needs the chat messages of the prompt (raw_prompt)")
        schemas = ctx.tools.schemas() or None
        messages = [dict(m) for m in sample.messages]
        prompt = chat.prompt_ids(messages, schemas)
        info = dict.fromkeys(_COUNTERS, 0.0)
        if ctx.prompt_length is not None and len(prompt) > ctx.prompt_length:  # the tool schemas made it longer than the data's check allowed
            logger.warning("row %d: the prompt with tool schemas has %d tokens > rollout.prompt_length=%d; "
                           "keeping the last %d", sample.row, len(prompt), ctx.prompt_length, ctx.prompt_length)
            prompt, info["prompt_truncated"] = prompt[-ctx.prompt_length:], 1.0
        t = Transcript(prompt, with_log_probs=ctx.sampling.calculate_log_probs)
        assistant = user = 0
        tool_rewards: list[float] = []
        while True:
            out = await ctx.engine.generate(TurnRequest(t.ids, ctx.budget(t), sample.seed(assistant)))
            t.add_sampled(out.token_ids, out.log_probs, out.versions)
            assistant += 1
            stop_text = chat.decode(out.token_ids[-1:]) if out.finish_reason == "stop" else None
            content = chat.decode(out.token_ids[:-1] if stop_text is not None else out.token_ids)
            messages.append({"role": "assistant", "content": content})
            reason = StopReason.LENGTH if out.finish_reason == "length" or ctx.budget(t) <= 0 else None
            calls = parse_hermes(content)[1] if reason is None else []
            if reason is None and not calls:
                reason = StopReason.ANSWER
            if reason is None and ctx.multi_turn.max_assistant_turns and assistant >= ctx.multi_turn.max_assistant_turns:
                reason = StopReason.MAX_ASSISTANT_TURNS
            if reason is None and ctx.multi_turn.max_user_turns and user >= ctx.multi_turn.max_user_turns:
                reason = StopReason.MAX_USER_TURNS
            if reason is not None:
                break
            results = await ctx.tools.run_turn(calls, (sample.extra_info or {}).get("tools_kwargs"))
            _count(info, calls, results)
            tool_rewards.extend(_call_reward(r) for r in results)
            tool_messages = [{"role": "tool", "content": chat.normalize(r.text)} for r in results]
            inserted = chat.insertion_ids(tool_messages, stop_text, schemas)
            if len(t) + len(inserted) >= ctx.response_length:  # no room left for the model to reply
                reason = StopReason.LENGTH
                break
            t.add_inserted(inserted)
            messages.extend(tool_messages)
            user += 1
        info["assistant_turns"] = float(assistant)
        if not info.get("prompt_truncated"):
            diff = chat.check(t.ids, messages, stop_text, schemas)
            info["tokenization_mismatch"] = float(diff is not None)
            if diff is not None:
                logger.warning("row %d: tokenization sanity check (%s): %s", sample.row, chat.sanity_mode, diff)
        return t.output(reason, num_turns=assistant + user + 1, info=info, tool_rewards=tool_rewards)


def _call_reward(result) -> float:
    """A call's entry in `tool_rewards`: the tool's reward, 0.0 where it gave none or the call failed
    (verl's loop records 0.0 for an unknown tool, bad arguments or an exception, and its function
    tools 0.0 for a response without a reward)."""
    return 0.0 if result.reward is None else float(result.reward)


def _count(info: dict, calls, results) -> None:
    info["tool_calls"] += len(results)
    info["tool_calls_dropped"] += len(calls) - len(results)
    for r in results:
        info["tool_errors"] += r.error is not None
        info["tool_timeouts"] += r.error == "timeout"
        info["malformed_tool_calls"] += r.error == "malformed_call"
        info["unknown_tool_calls"] += r.error == "unknown_tool"
        info["tool_latency_s"] += r.latency_s
        info["tool_latency_max_s"] = max(info["tool_latency_max_s"], r.latency_s)
