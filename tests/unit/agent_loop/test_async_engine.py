"""The request-level engine: seeds, admission order, concurrency, failures, and the HF tokens recorded from
the batched rollout."""

import asyncio
import time

import pytest
import torch

from ballast.protocol import Batch
from ballast.workers.agent_loop import AgentLoopRunner, AgentLoopSpec
from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend
from ballast.workers.rollout.async_engine import AsyncEngine, TurnRequest, request_seed
from ballast.workers.rollout.base import sampling_seed
from testkit import same_tokens
from testkit.agent import FakeCore
from testkit.prompts import left_padded_prompts

PROMPTS = [[5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15, 16, 17], [9], [20, 21, 22]]


def test_turn_zero_seed_is_the_batched_seed_and_later_turns_differ():
    assert request_seed(3, 1, 7, 4, 0) == sampling_seed(3, 1, 7, 4)
    seeds = {request_seed(3, 1, 7, row, turn) for row in range(4) for turn in range(4)}
    assert len(seeds) == 16 and all(0 <= s < 2 ** 63 for s in seeds)
    assert request_seed(None, 0, 0, 0, 2) is None


def test_requests_submitted_together_are_added_in_order_before_the_first_step():
    core = FakeCore()

    async def main():
        async with AsyncEngine(core) as engine:
            return await asyncio.gather(*(engine.generate(TurnRequest([i + 1], 4)) for i in range(5)))

    outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == [(7, 8)] * 5
    assert core.log == [("add", f"t{i}") for i in range(5)] + [("step", 5)]


def test_a_finished_turns_next_turn_joins_the_following_step():
    """The engine yields between steps: a conversation woken by a step submits its next turn before the
    next one, so a two-turn conversation beside a slow one takes consecutive steps."""
    core = FakeCore(steps_of=lambda r: 4 if r.prompt_ids == (9,) else 1)

    async def two_turns(engine):
        await engine.generate(TurnRequest([1], 4))
        await engine.generate(TurnRequest([2], 4))

    async def main():
        async with AsyncEngine(core) as engine:
            await asyncio.gather(engine.generate(TurnRequest([9], 4)), two_turns(engine))
            return engine.steps

    assert asyncio.run(main()) == 4
    assert core.log == [("add", "t0"), ("add", "t1"), ("step", 2), ("add", "t2"), ("step", 2), ("step", 1),
                        ("step", 1)]


def test_conversations_advance_concurrently_while_others_wait_on_a_tool():
    """A conversation sleeping (a 'tool') does not hold the engine: another one finishes its turns meanwhile."""
    core = FakeCore(steps_of=lambda r: 2)
    order = []

    async def conversation(engine, name, turns, pause):
        for t in range(turns):
            await engine.generate(TurnRequest([1, t + 1], 4))
            order.append((name, t))
            await asyncio.sleep(pause)

    async def main():
        async with AsyncEngine(core) as engine:
            await asyncio.gather(conversation(engine, "slow", 2, 0.3), conversation(engine, "fast", 4, 0.0))

    start = time.perf_counter()
    asyncio.run(main())
    assert time.perf_counter() - start < 1.5
    assert order.index(("fast", 3)) < order.index(("slow", 1))


def test_an_engine_failure_reaches_every_waiting_conversation_and_nothing_hangs():
    core = FakeCore(steps_of=lambda r: 3, fail_at_step=2)

    async def main():
        async with AsyncEngine(core) as engine:
            return await asyncio.gather(*(engine.generate(TurnRequest([1], 4)) for _ in range(3)),
                                        return_exceptions=True)

    with pytest.raises(RuntimeError, match="rollout engine failed"):
        asyncio.run(asyncio.wait_for(main(), 10))


@pytest.fixture(scope="module")
def hf_backend(tiny_dir):
    sampling = SamplingConfig(max_response_length=12, seed=7, calculate_log_probs=True)
    return build_backend(RolloutConfig(model_path=tiny_dir, backend="hf", device="cpu", sampling=sampling))


def test_hf_core_cuts_each_request_at_its_own_budget_and_stop(hf_backend):
    sampling = SamplingConfig(max_response_length=12, seed=7, calculate_log_probs=True, ignore_eos=True)
    core = hf_backend.core(sampling)
    core.add("a", TurnRequest([5, 6], 3, seed=1))
    core.add("b", TurnRequest([9], 7, seed=2))
    done = dict(core.step())
    assert len(done["a"].token_ids) == 3 and len(done["b"].token_ids) == 7
    assert done["a"].finish_reason == done["b"].finish_reason == "length"
    assert len(done["b"].log_probs) == 7 and not core.has_unfinished()


def test_hf_samples_the_tokens_the_batched_rollout_recorded(hf_backend, tiny_dir):
    """tests/fixtures/same_tokens.json: what the batched HF rollout recorded (sampled, filtered,
    greedy), through the worker's generate path (single-turn agent loops on the HF core)."""
    fixture = same_tokens.load()
    same_tokens.check_model(fixture, "tiny", tiny_dir)
    same_tokens.check_engine(fixture, "hf", hf_backend)
    runner = AgentLoopRunner(hf_backend, AgentLoopSpec(tokenizer_path=tiny_dir, prompt_length=16))
    generate = same_tokens.generate_with(runner)
    for name, out in same_tokens.run_calls(fixture, generate, fixture["prompts"]["tp1"]).items():
        same_tokens.assert_same_tokens(fixture["results"]["hf"][name], out, f"hf/{name}")
        assert set(out.keys()) == {"prompts", "responses", "response_mask", "input_ids", "attention_mask",
                                   "position_ids", "rollout_log_probs"}


def test_multi_turn_rollout_log_probs_are_those_of_the_final_sequence(hf_backend, tiny_dir):
    """Teacher-forcing the assembled sequence reproduces every sampled token's rollout log-prob: the
    engine saw exactly this context (sampled + inserted tokens) when it sampled each token."""
    from testkit.agent import INSERTED, register_inserting_loop

    register_inserting_loop()
    sampling = SamplingConfig(max_response_length=32, seed=3, calculate_log_probs=True, ignore_eos=True)
    prompts = Batch(left_padded_prompts(PROMPTS[:3], position_ids=True),
                    non_tensors={"agent_name": ["test_inserting_agent"] * 3})
    runner = AgentLoopRunner(hf_backend, AgentLoopSpec(tokenizer_path=tiny_dir, prompt_length=16))
    out = runner.generate(prompts, sampling, call_index=1).tensors
    model = hf_backend.model
    for row in range(3):
        real = out["attention_mask"][row].bool()
        seq = out["input_ids"][row][real]
        n_resp = int(out["attention_mask"][row, -32:].sum())
        assert n_resp == 3 * 6 + 2 * len(INSERTED)
        mask = out["response_mask"][row, :n_resp].bool()
        with torch.no_grad():
            logits = model(seq[None], use_cache=False).logits[0, -n_resp - 1:-1].float()
        teacher = torch.log_softmax(logits, -1).gather(1, seq[-n_resp:, None])[:, 0]
        rollout = out["rollout_log_probs"][row, :n_resp]
        assert torch.allclose(rollout[mask], teacher[mask], atol=1e-4)
        assert (rollout[~mask] == 0).all() and int((~mask).sum()) == 2 * len(INSERTED)
        assert out["responses"][row, :n_resp][~mask].tolist() == list(INSERTED) * 2
