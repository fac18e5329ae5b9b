"""Partial rollouts: a weight update during a generation interrupts the requests in flight, which finish
under the new weights, every token carrying the version that sampled it (HF backend, tiny model)."""

import copy

import pytest
import torch

from ballast.protocol import Batch
from ballast.workers.agent_loop import AgentLoopRunner, AgentLoopSpec
from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend
from ballast.workers.rollout.async_engine import TurnRequest
from ballast.workers.rollout.hf_backend import HF_RESUMABLE_STEP_TOKENS, HFCore
from ballast.workers.rollout.resume import ResumingCore
from testkit.prompts import left_padded_prompts

PROMPTS = [[5, 6, 7, 8], [9], [10, 11], [12, 13, 14]]
BUDGET = 40  # > 2 slices of HF_RESUMABLE_STEP_TOKENS: an update after the first slice lands mid-request


@pytest.fixture(scope="module")
def backend(tiny_dir):
    sampling = SamplingConfig(max_response_length=BUDGET, seed=7, calculate_log_probs=True, ignore_eos=True,
                              do_sample=False)
    return build_backend(RolloutConfig(model_path=tiny_dir, backend="hf", device="cpu", sampling=sampling))


@pytest.fixture
def two_versions(backend):
    """The backend's weights (version 0) and a perturbed copy (version 1); version 0 is restored after."""
    v0 = copy.deepcopy(backend.model.state_dict())
    gen = torch.Generator().manual_seed(0)
    v1 = {k: t + 0.05 * torch.randn(t.shape, generator=gen) if t.is_floating_point() else t.clone()
          for k, t in v0.items()}
    yield {0: v0, 1: v1}
    backend.model.load_state_dict(v0)


class Updates:
    """Newer weights become available before engine step `at` (counted from 1)."""

    def __init__(self, backend, states, at):
        self.backend, self.states, self.at = backend, states, at
        self.version, self.polls, self.loads = 0, 0, []

    def newer(self):
        self.polls += 1
        return 1 if self.polls >= self.at and self.version == 0 else None

    def load(self, version):
        self.backend.model.load_state_dict(self.states[version])
        self.loads.append(version)
        self.version = version
        return version


def _greedy(model, prompt, n):
    """n greedy tokens after `prompt` and their log-probs, by teacher forcing one token at a time."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            token = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt):], lps


def test_without_an_update_a_sliced_hf_core_samples_what_the_whole_request_core_does(backend):
    sampling = backend.config.sampling
    whole, sliced = HFCore(backend, sampling), backend.core(sampling, resumable=True)
    assert sliced.step_tokens == HF_RESUMABLE_STEP_TOKENS
    for core in (whole, sliced):
        for i, p in enumerate(PROMPTS):
            core.add(f"r{i}", TurnRequest(p, BUDGET))
    expected = dict(whole.step())
    got, steps = {}, 0
    while sliced.has_unfinished():
        got.update(sliced.step())
        steps += 1
    assert steps == -(-BUDGET // HF_RESUMABLE_STEP_TOKENS)
    for rid, out in expected.items():
        assert got[rid].token_ids == out.token_ids
        assert torch.allclose(torch.tensor(got[rid].log_probs), torch.tensor(out.log_probs), atol=1e-4)


def test_an_update_mid_request_resumes_it_under_the_new_weights_with_each_tokens_version(backend, two_versions):
    updates = Updates(backend, two_versions, at=2)  # after the first slice
    core = ResumingCore(backend.core(backend.config.sampling, resumable=True), updates)
    prompt = PROMPTS[0]
    core.add("a", TurnRequest(prompt, BUDGET))
    outs = []
    while core.has_unfinished():
        outs += core.step()
    (rid, out), = outs
    k = HF_RESUMABLE_STEP_TOKENS
    assert updates.loads == [1] and core.interruptions == 1 and core.resumed_requests == 1
    assert out.versions == (0,) * k + (1,) * (BUDGET - k) and len(out.token_ids) == BUDGET
    backend.model.load_state_dict(two_versions[0])
    head, head_lps = _greedy(backend.model, prompt, k)
    backend.model.load_state_dict(two_versions[1])
    tail, tail_lps = _greedy(backend.model, prompt + head, BUDGET - k)
    assert list(out.token_ids) == head + tail  # the new weights continue from the prefix the old ones sampled
    assert torch.allclose(torch.tensor(out.log_probs), torch.tensor(head_lps + tail_lps), atol=1e-4)
    assert out.finish_reason == "length"


def test_requests_not_started_when_the_update_lands_are_sampled_wholly_by_the_new_weights(backend, two_versions):
    updates = Updates(backend, two_versions, at=2)
    inner = HFCore(backend, backend.config.sampling, max_batch=1, step_tokens=BUDGET)  # one request per step
    core = ResumingCore(inner, updates)
    core.add("first", TurnRequest(PROMPTS[0], 8))
    core.add("second", TurnRequest(PROMPTS[1], 8))
    done = {}
    while core.has_unfinished():
        done.update(core.step())
    assert done["first"].versions == (0,) * 8 and done["second"].versions == (1,) * 8
    assert core.resumed_requests == 0  # "second" had sampled nothing: re-added whole, nothing resumed


def test_the_runner_returns_every_sampled_tokens_version_and_keeps_the_budgets(backend, tiny_dir, two_versions):
    updates = Updates(backend, two_versions, at=2)
    runner = AgentLoopRunner(backend, AgentLoopSpec(tokenizer_path=tiny_dir, prompt_length=16))
    prompts = Batch(left_padded_prompts(PROMPTS, position_ids=True))
    out = runner.generate(prompts, backend.config.sampling, call_index=1, updates=updates).tensors
    versions, mask = out["rollout_versions"], out["response_mask"].bool()
    assert versions.shape == out["responses"].shape
    assert (versions[~mask] == -1).all() and set(versions[mask].tolist()) == {0, 1}
    for row in range(len(PROMPTS)):
        v = versions[row][mask[row]].tolist()
        assert v == sorted(v), "a token is never older than the tokens before it"
        assert len(v) == BUDGET
    plain = runner.generate(prompts, backend.config.sampling, call_index=1).tensors
    assert "rollout_versions" not in plain.keys()


def test_a_failed_load_mid_call_fails_the_call_naming_it_and_nothing_hangs(backend, tiny_dir):
    class Broken:
        version = 0

        def newer(self):
            return "v1"

        def load(self, weights):
            raise RuntimeError("rollout rank 0 loaded 3 of the 12 exported tensors")

    runner = AgentLoopRunner(backend, AgentLoopSpec(tokenizer_path=tiny_dir, prompt_length=16))
    prompts = Batch(left_padded_prompts(PROMPTS, position_ids=True))
    with pytest.raises(RuntimeError, match="loaded 3 of the 12 exported tensors"):
        runner.generate(prompts, backend.config.sampling, call_index=1, updates=Broken())
    again = runner.generate(prompts, backend.config.sampling, call_index=1)  # the backend still serves
    assert again.tensors["responses"].shape[0] == len(PROMPTS)
