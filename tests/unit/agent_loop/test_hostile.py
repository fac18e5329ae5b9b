"""Hostile tools and models: a tool that raises, hangs (blocking or not), prints megabytes or returns
invalid UTF-8; a model that writes malformed calls or calls unknown tools. Each conversation goes on
or ends with a recorded reason, the other conversations are not held up, and nothing hangs."""

import asyncio
import time

import pytest

from ballast.tools import CalculatorTool, PythonExpressionTool, Tool, ToolResponse
from ballast.tools.executor import ToolCall, ToolExecutor
from ballast.workers.agent_loop import AgentSample, ChatFormat, StopReason, ToolAgentLoop
from ballast.workers.agent_loop.metrics import agent_metrics
from ballast.workers.agent_loop.output import sample_columns
from testkit.agent import ScriptedEngine, make_context


def _schema(name):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}, "required": []}}}


class Raises(Tool):
    default_schema = _schema("raises")

    async def execute(self, instance_id, parameters, **kw):
        raise KeyError("boom")


class BlocksTheThread(Tool):
    default_schema = _schema("blocks")

    async def execute(self, instance_id, parameters, **kw):
        time.sleep(30)  # a synchronous sleep inside a coroutine: would freeze a shared event loop
        return "late"


class NeverReturns(Tool):
    default_schema = _schema("hangs")

    async def execute(self, instance_id, parameters, **kw):
        await asyncio.Event().wait()


class Floods(Tool):
    default_schema = _schema("floods")

    async def execute(self, instance_id, parameters, **kw):
        return "x" * (20 << 20)  # 20 MB of text


class BadBytes(Tool):
    default_schema = _schema("bad_bytes")

    async def execute(self, instance_id, parameters, **kw):
        return ToolResponse(text=b"ok \xff\xfe \xed\xa0\x80 end".decode("utf-8", "surrogateescape"))


CALL = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
SCRIPTS = {
    "raises": [CALL % ("raises", "{}"), "done"],
    "blocks": [CALL % ("blocks", "{}"), "done"],
    "hangs": [CALL % ("hangs", "{}"), "done"],
    "floods": [CALL % ("floods", "{}"), "done"],
    "bad_bytes": [CALL % ("bad_bytes", "{}"), "done"],
    "sandbox_loop": [CALL % ("python", '{"expression": "sum(i for i in range(10**12))"}'), "done"],
    "sandbox_print": [CALL % ("python", '{"expression": "\'y\' * (5 * 10**6)"}'), "done"],
    "malformed": ['<tool_call>{"name": calculator}</tool_call>', '<tool_call>{"name": "calculator"', "done"],
    "unknown": [CALL % ("teleport", '{"to": "mars"}'), "done"],
    "bad_args": [CALL % ("calculator", '{"expr": 1}'), "done"],
    "normal": ["fine"],
}


def test_hostile_tools_and_models_are_recorded_and_nothing_hangs(tiny_tokenizer):
    tools = {t.name: t for t in (Raises(), BlocksTheThread({"timeout_s": 1}), NeverReturns({"timeout_s": 1}), Floods(),
                                 BadBytes(), CalculatorTool(), PythonExpressionTool({"timeout_s": 5, "memory_mb": 128}))}
    keys = sorted(SCRIPTS)
    chat = ChatFormat(tiny_tokenizer)
    prompts = {k: chat.prompt_ids([{"role": "user", "content": f"case {k}"}]) for k in keys}
    key_of = lambda ids: next(k for k in keys if list(ids[: len(prompts[k])]) == prompts[k])
    engine = ScriptedEngine(tiny_tokenizer, SCRIPTS, key_of, tiny_tokenizer.eos_token_id)
    ctx = make_context(engine, tiny_tokenizer, tools, response_length=2048, max_tool_response_length=300)
    loop = ToolAgentLoop(ctx)

    async def main():
        samples = [AgentSample(i, prompts[k], [{"role": "user", "content": f"case {k}"}]) for i, k in enumerate(keys)]
        return await asyncio.wait_for(asyncio.gather(*(loop.run(s) for s in samples)), 60)

    start = time.perf_counter()
    outs = dict(zip(keys, asyncio.run(main())))
    elapsed = time.perf_counter() - start
    assert elapsed < 15, elapsed  # the 30 s blocking tool and the endless one were cut at their 1 s limits
    for key, out in outs.items():
        assert out.stop_reason == StopReason.ANSWER, key  # every conversation got to its final turn
        assert out.info["tokenization_mismatch"] == 0.0, key
    inserted = {k: chat.decode([t for t, m in zip(o.response_ids, o.response_mask) if not m]) for k, o in outs.items()}
    assert outs["raises"].info["tool_errors"] == 1 and "KeyError" in inserted["raises"]
    for key in ("blocks", "hangs"):
        assert outs[key].info["tool_timeouts"] == 1 and "did not answer within 1 s" in inserted[key]
    assert outs["sandbox_loop"].info["tool_timeouts"] == 1 and "TimeoutError" in inserted["sandbox_loop"]
    assert "(truncated)" in inserted["floods"] and len(inserted["floods"]) < 600
    assert "(truncated)" in inserted["sandbox_print"] and len(inserted["sandbox_print"]) < 600
    assert "ok \ufffd\ufffd" in inserted["bad_bytes"] and outs["bad_bytes"].info["tool_errors"] == 0
    assert outs["malformed"].info["malformed_tool_calls"] == 2 and outs["malformed"].num_turns == 6
    assert outs["unknown"].info["unknown_tool_calls"] == 1 and "unknown tool 'teleport'" in inserted["unknown"]
    assert outs["bad_args"].info["tool_errors"] == 1 and "missing required argument(s) ['expression']" in inserted["bad_args"]
    metrics = agent_metrics(sample_columns(list(outs.values()), ["tool_agent"] * len(outs)))
    assert metrics["agent/tool_timeouts/total"] == 3 and metrics["agent/malformed_tool_calls/total"] == 2
    assert metrics["agent/stop_reason/answer"] == 1.0 and metrics["agent/tool_use_frac"] == 10 / 11


def test_parallel_calls_are_bounded_and_run_concurrently():
    class Sleeps(Tool):
        default_schema = _schema("sleep")

        async def execute(self, instance_id, parameters, **kw):
            await asyncio.sleep(1.0)
            return "slept"

    executor = ToolExecutor({"sleep": Sleeps()}, max_parallel_calls=3)
    start = time.perf_counter()
    results = asyncio.run(executor.run_turn([ToolCall("sleep", {})] * 5))
    assert len(results) == 3 and all(r.text == "slept" for r in results)
    # three 1 s calls at once, not one after another (3 s); the margin absorbs a loaded box
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("side, expected", [("left", "(truncated)...6789"), ("right", "0123...(truncated)"),
                                            ("middle", "01...(truncated)...89")])
def test_tool_response_truncation_sides(side, expected):
    from ballast.tools import truncate

    assert truncate("0123456789", 4, side) == expected
    assert truncate("0123", 4, side) == "0123"


def test_a_timed_out_async_tool_is_cancelled_and_released():
    released = []

    class Waits(Tool):
        default_schema = _schema("waits")

        async def execute(self, instance_id, parameters, **kw):
            await asyncio.sleep(60)

        async def release(self, instance_id, **kw):
            released.append(instance_id)

    executor = ToolExecutor({"waits": Waits({"timeout_s": 0.2})})
    result = asyncio.run(executor.run_call(ToolCall("waits", {}), {}))
    assert result.error == "timeout"
    deadline = time.monotonic() + 5
    while not released and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(released) == 1
