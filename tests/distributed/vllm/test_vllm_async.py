"""Request-level rollout on a real vLLM CPU engine (one engine per module): single-turn rollouts sample
what the batched rollout recorded (tests/fixtures/same_tokens.json), multi-turn log-probs line up with
the final sequence, requests join a running engine mid-flight, weight sync reaches the rollout, and an
update mid-request resumes it under the new weights."""

import asyncio

import pytest
import torch

from ballast.protocol import Batch
from ballast.workers.agent_loop import AgentLoopRunner, AgentLoopSpec
from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend, iter_full_tensors, load_weights
from ballast.workers.rollout.async_engine import AsyncEngine, TurnRequest
from testkit import same_tokens
from testkit.agent import INSERTED, register_inserting_loop
from testkit.prompts import left_padded_prompts
from testkit.rollout import generate

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

PROMPTS = [[5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15, 16, 17], [9], [20, 21, 22], [30, 31], [40]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from ballast.models import build_tiny_model

    return str(build_tiny_model(str(tmp_path_factory.mktemp("vllm_async_tiny")), preset="tiny", seed=0))


@pytest.fixture(scope="module")
def engine(model_dir):
    cfg = RolloutConfig(model_path=model_dir, backend="vllm", device="cpu", max_model_len=128,
                        kv_cache_memory_bytes=32 << 20, max_num_seqs=32,
                        sampling=SamplingConfig(max_response_length=16, seed=11, calculate_log_probs=True))
    backend = build_backend(cfg)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def runner(engine, model_dir):
    register_inserting_loop()
    return AgentLoopRunner(engine, AgentLoopSpec(tokenizer_path=model_dir, prompt_length=16))


def test_vllm_samples_the_tokens_the_batched_rollout_recorded(engine, runner, model_dir):
    """tests/fixtures/same_tokens.json: what the batched vLLM rollout (TP 1) recorded (sampled,
    filtered, greedy), through the worker's generate path (single-turn agent loops on the vLLM core)."""
    fixture = same_tokens.load()
    same_tokens.check_model(fixture, "tiny", model_dir)
    same_tokens.check_engine(fixture, "vllm_tp1", engine)
    for name, out in same_tokens.run_calls(fixture, same_tokens.generate_with(runner), fixture["prompts"]["tp1"]).items():
        same_tokens.assert_same_tokens(fixture["results"]["vllm_tp1"][name], out, f"vllm_tp1/{name}")


def test_multi_turn_log_probs_line_up_with_the_final_sequence(engine, runner):
    sampling = SamplingConfig(max_response_length=32, seed=11, calculate_log_probs=True, ignore_eos=True)
    prompts = Batch(left_padded_prompts(PROMPTS, position_ids=True),
                    non_tensors={"agent_name": ["test_inserting_agent"] * len(PROMPTS)})
    out = runner.generate(prompts, sampling, call_index=2).tensors
    sequences, spans = [], []
    for row in range(len(PROMPTS)):
        seq = out["input_ids"][row][out["attention_mask"][row].bool()].tolist()
        n = int(out["attention_mask"][row, -32:].sum())
        assert n == 3 * 6 + 2 * len(INSERTED)
        sequences.append(seq)
        spans.append(n)
    teacher = engine.prompt_log_probs(sequences)
    for row, (lp, n) in enumerate(zip(teacher, spans)):
        mask = out["response_mask"][row, :n].bool()
        rollout = out["rollout_log_probs"][row, :n]
        assert torch.allclose(rollout[mask], lp[-n:][mask], atol=1e-4), row
        assert (rollout[~mask] == 0).all()


def test_requests_join_a_running_engine(engine):
    """A request submitted while others are decoding is served without waiting for them to finish."""
    sampling = SamplingConfig(max_response_length=64, seed=1, ignore_eos=True)

    async def main():
        async with AsyncEngine(engine.core(sampling)) as eng:
            long = asyncio.ensure_future(eng.generate(TurnRequest([5, 6], 64, seed=1)))
            await asyncio.sleep(0)  # let the long one start
            while eng.steps < 3:
                await asyncio.sleep(0.001)
            short = await eng.generate(TurnRequest([7], 4, seed=2))
            steps_when_short_done = eng.steps
            await long
            return short, steps_when_short_done, eng.steps

    short, at_short, total = asyncio.run(main())
    assert len(short.token_ids) == 4 and at_short < total


def test_weight_sync_reaches_async_rollouts(engine, runner, model_dir):
    from transformers import AutoModelForCausalLM

    sampling = SamplingConfig(max_response_length=8, seed=3, do_sample=False, calculate_log_probs=True)
    prompts = Batch(left_padded_prompts(PROMPTS[:4], position_ids=True))
    before = runner.generate(prompts, sampling).tensors
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    try:
        load_weights(engine, iter_full_tensors(model))
        after = runner.generate(prompts, sampling).tensors
        assert not torch.equal(after["rollout_log_probs"], before["rollout_log_probs"])
        # every sampled token's log-prob is the synced weights' (teacher forcing on the engine)
        sequences = [after["input_ids"][i][after["attention_mask"][i].bool()].tolist() for i in range(4)]
        for row, teacher in enumerate(engine.prompt_log_probs(sequences)):
            n = int(after["response_mask"][row].sum())
            assert torch.allclose(after["rollout_log_probs"][row, :n], teacher[-n:], atol=1e-4), row
    finally:
        model.load_state_dict(original)
        load_weights(engine, iter_full_tensors(model))


def test_an_update_mid_request_resumes_it_under_the_new_weights_vllm(engine, model_dir):
    """Partial rollouts on vLLM: new weights arrive after a few engine steps; every request keeps the
    tokens the old weights sampled, re-reads its prefix under the new ones and continues greedily from
    it; each token's log-prob is its own version's (teacher forcing) and its version is recorded."""
    from transformers import AutoModelForCausalLM

    from ballast.workers.rollout.resume import ResumingCore

    budget = 12
    sampling = SamplingConfig(max_response_length=budget, seed=3, do_sample=False, calculate_log_probs=True,
                              ignore_eos=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    v1 = {k: v.clone() for k, v in model.state_dict().items()}

    def load(state):
        model.load_state_dict(state)
        load_weights(engine, iter_full_tensors(model))

    class Updates:
        version, polls = 0, 0

        def newer(self):
            self.polls += 1
            return v1 if self.polls == 4 else None  # before the 4th engine step

        def load(self, state):
            load(state)
            self.version = 1
            return 1

    prompts = PROMPTS[:4]
    try:
        core = ResumingCore(engine.core(sampling, resumable=True), Updates())
        for i, p in enumerate(prompts):
            core.add(f"r{i}", TurnRequest(p, budget))
        done = {}
        while core.has_unfinished():
            done.update(core.step())
        outs = [done[f"r{i}"] for i in range(len(prompts))]
        heads = {out.versions.count(0) for out in outs}
        assert len(heads) == 1 and 0 < next(iter(heads)) < budget, heads  # all in flight for the same steps
        head = heads.pop()
        for out in outs:
            assert out.versions == (0,) * head + (1,) * (budget - head) and len(out.token_ids) == budget
        # the tail is the new weights' greedy continuation of prompt + head
        continued = generate(engine, left_padded_prompts([p + list(o.token_ids[:head]) for p, o in zip(prompts, outs)]),
                                    SamplingConfig(max_response_length=budget - head, do_sample=False,
                                                   ignore_eos=True))
        for row, out in enumerate(outs):
            assert list(out.token_ids[head:]) == continued["responses"][row].tolist()
        sequences = [p + list(o.token_ids) for p, o in zip(prompts, outs)]
        new_lps = engine.prompt_log_probs(sequences)
        load(v0)
        old_lps = engine.prompt_log_probs(sequences)
        for out, old, new in zip(outs, old_lps, new_lps):
            lps = torch.tensor(out.log_probs)
            assert torch.allclose(lps[:head], old[-budget:][:head], atol=1e-4)
            assert torch.allclose(lps[head:], new[-budget:][head:], atol=1e-4)
    finally:
        load(v0)
