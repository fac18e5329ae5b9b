"""The request-level engine: seeds, admission order, concurrency, failures, and HF single-turn exactness."""

import asyncio
import threading
import time

import pytest
import torch

from ballast.protocol import Batch
from ballast.workers.agent_loop import AgentLoopRunner, AgentLoopSpec
from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend
from ballast.workers.rollout.async_engine import AsyncEngine, HFCore, TurnRequest, request_seed
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
    seen = []

    async def main():
        async with AsyncEngine(core, on_step=lambda adds: seen.append([rid for rid, _ in adds])) as engine:
            return await asyncio.gather(*(engine.generate(TurnRequest([i + 1], 4)) for i in range(5)))

    outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == [(7, 8)] * 5
    assert core.log[:6] == [("add", f"t{i}") for i in range(5)] + [("step", 5)]
    assert seen[0] == [f"t{i}" for i in range(5)]


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


class _PerThreadCuda:
    """CUDA's current device as the runtime keeps it, faked on CPU: one per thread, device 0 in a new one."""

    def __init__(self, monkeypatch):
        self._local, self.selected = threading.local(), []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(self._local, "device", 0))
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)

    def set_device(self, device):
        self._local.device = device
        self.selected.append((threading.current_thread().name, device))


class _DeviceRecordingCore(FakeCore):
    def __init__(self):
        super().__init__()
        self.devices = []

    def add(self, request_id, request):
        self.devices.append(("add", torch.cuda.current_device()))
        super().add(request_id, request)

    def step(self):
        self.devices.append(("step", torch.cuda.current_device()))
        return super().step()


def test_the_engine_thread_works_on_the_device_of_the_worker_thread(monkeypatch):
    """Where Ray leaves every GPU visible (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), a worker picks
    its GPU with torch.cuda.set_device, which holds for its own thread only: the engine thread, where
    vLLM allocates and launches, must pick the same one before it touches the engine."""
    cuda = _PerThreadCuda(monkeypatch)
    cuda.set_device(3)  # the worker's GPU, chosen in its own thread (init_distributed does this)
    core = _DeviceRecordingCore()

    async def main():
        async with AsyncEngine(core) as engine:
            return await asyncio.gather(*(engine.generate(TurnRequest([1], 4)) for _ in range(2)))

    assert [o.token_ids for o in asyncio.run(main())] == [(7, 8)] * 2
    assert core.devices == [("add", 3), ("add", 3), ("step", 3)]
    assert ("ballast-rollout-engine", 3) in cuda.selected


def test_a_cpu_process_never_touches_cuda_from_the_engine_thread(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("set_device on a CPU run"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)

    async def main():
        async with AsyncEngine(FakeCore()) as engine:
            return await engine.generate(TurnRequest([1], 4))

    assert asyncio.run(main()).token_ids == (7, 8)


@pytest.fixture(scope="module")
def hf_backend(tiny_dir):
    sampling = SamplingConfig(max_response_length=12, seed=7, calculate_log_probs=True)
    return build_backend(RolloutConfig(model_path=tiny_dir, backend="hf", device="cpu", sampling=sampling))


def test_hf_core_cuts_each_request_at_its_own_budget_and_stop(hf_backend):
    sampling = SamplingConfig(max_response_length=12, seed=7, calculate_log_probs=True, ignore_eos=True)
    core = HFCore(hf_backend, sampling)
    core.add("a", TurnRequest([5, 6], 3, seed=1))
    core.add("b", TurnRequest([9], 7, seed=2))
    done = dict(core.step())
    assert len(done["a"].token_ids) == 3 and len(done["b"].token_ids) == 7
    assert done["a"].finish_reason == done["b"].finish_reason == "length"
    assert len(done["b"].log_probs) == 7 and not core.has_unfinished()


@pytest.mark.parametrize("do_sample", [True, False])
def test_single_turn_async_equals_batched_generation_token_for_token(hf_backend, tiny_dir, do_sample):
    sampling = SamplingConfig(max_response_length=12, seed=7, calculate_log_probs=True, do_sample=do_sample)
    prompts = left_padded_prompts(PROMPTS, position_ids=True)
    batched = hf_backend.generate(prompts, sampling, call_index=3)
    runner = AgentLoopRunner(hf_backend, AgentLoopSpec(tokenizer_path=tiny_dir, prompt_length=16, response_length=12))
    result = runner.generate(Batch(prompts), sampling, call_index=3)
    assert sorted(result.tensors.keys()) == sorted(batched.keys())
    for key in batched.keys():
        assert torch.equal(result.tensors[key], batched[key]), key
    stops = result.columns["agent_stop_reason"]
    assert set(stops) <= {"answer", "length"}
    assert list(result.columns["agent_num_turns"]) == [2] * len(PROMPTS)


@pytest.mark.parametrize("path", ["batched", "request"])
def test_hf_samples_the_tokens_the_batched_rollout_recorded(hf_backend, tiny_dir, path):
    """tests/fixtures/same_tokens.json: what the batched HF rollout recorded (sampled, filtered,
    greedy), through each generate entry point of the worker."""
    fixture = same_tokens.load()
    same_tokens.check_model(fixture, "tiny", tiny_dir)
    same_tokens.check_engine(fixture, "hf", hf_backend)
    runner = AgentLoopRunner(hf_backend, AgentLoopSpec(tokenizer_path=tiny_dir, prompt_length=16, response_length=16))
    generate = same_tokens.entry_points(hf_backend, runner)[path]
    for name, out in same_tokens.run_calls(fixture, generate, fixture["prompts"]["tp1"]).items():
        same_tokens.assert_same_tokens(fixture["results"]["hf"][name], out, f"hf/{path}/{name}")


def test_multi_turn_rollout_log_probs_are_those_of_the_final_sequence(hf_backend, tiny_dir):
    """Teacher-forcing the assembled sequence reproduces every sampled token's rollout log-prob: the
    engine saw exactly this context (sampled + inserted tokens) when it sampled each token."""
    from testkit.agent import INSERTED, register_inserting_loop

    register_inserting_loop()
    sampling = SamplingConfig(max_response_length=32, seed=3, calculate_log_probs=True, ignore_eos=True)
    prompts = Batch(left_padded_prompts(PROMPTS[:3], position_ids=True),
                    non_tensors={"agent_name": ["test_inserting_agent"] * 3})
    runner = AgentLoopRunner(hf_backend, AgentLoopSpec(tokenizer_path=tiny_dir, prompt_length=16, response_length=32))
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
