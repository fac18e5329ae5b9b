"""The HF backend through the rollout's generate path (single-turn agent loops on its core) against the
output contract, on a tiny random Qwen2 (CPU, fp32)."""

import contextlib

import pytest
import torch

from ballast.protocol.fields import check_fields
from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend
from ballast.workers.rollout.base import RolloutBackend
from ballast.workers.rollout.hf_backend import apply_sampling_filters
from testkit.prompts import left_padded_prompts
from testkit.rollout import filtered_log_probs, generate

PROMPTS = [[5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15, 16, 17], [9]]


def make_prompts(token_lists=PROMPTS, pad=0):
    return left_padded_prompts(token_lists, pad=pad)


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    cfg = RolloutConfig(
        model_path=tiny_model_dir, backend="hf", device="cpu",
        sampling=SamplingConfig(max_response_length=10, do_sample=False, pad_to_max_response_length=False),
    )
    return build_backend(cfg)


def greedy_reference(model, prompt, steps):
    """Greedy decoding by hand: one full forward per step, no cache, no padding."""
    tokens = list(prompt)
    log_probs = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens]), use_cache=False).logits[0, -1]
            lp = torch.log_softmax(logits.float(), -1)
            nxt = int(lp.argmax())
            tokens.append(nxt)
            log_probs.append(float(lp[nxt]))
    return tokens[len(prompt):], log_probs


def test_greedy_matches_manual_decoding_and_contract(backend, hf_reference_model):
    greedy = SamplingConfig(max_response_length=10, do_sample=False, eos_token_ids=(), calculate_log_probs=True)
    out = generate(backend, make_prompts(), greedy)
    sizes = check_fields(out, ["prompts", "responses", "response_mask", "input_ids", "attention_mask",
                               "position_ids", "rollout_log_probs"])
    assert sizes["R"] == 10 and sizes["B"] == len(PROMPTS)
    assert torch.equal(out["prompts"], make_prompts()["input_ids"])
    for i, prompt in enumerate(PROMPTS):
        tokens, lps = greedy_reference(hf_reference_model, prompt, 10)
        assert out["responses"][i].tolist() == tokens
        assert out["rollout_log_probs"][i].tolist() == pytest.approx(lps, abs=1e-4)
    # Identical prompts in different rows (left padding differs from neighbours') agree.
    assert torch.equal(out["responses"][1], out["responses"][4])
    assert (out["response_mask"] == 1).all()


def test_eos_and_stop_ids_cut_and_mask(backend):
    free = generate(backend, make_prompts(), SamplingConfig(max_response_length=10, do_sample=False, eos_token_ids=()))
    row0 = free["responses"][0].tolist()
    stop_token = row0[3]
    first = row0.index(stop_token)
    for sampling in (
        SamplingConfig(max_response_length=10, do_sample=False, eos_token_ids=(stop_token,)),
        SamplingConfig(max_response_length=10, do_sample=False, eos_token_ids=(), stop_token_ids=(stop_token,)),
    ):
        out = generate(backend, make_prompts(), sampling)
        assert out["responses"][0, : first + 1].tolist() == row0[: first + 1]
        assert out["response_mask"][0].tolist() == [1] * (first + 1) + [0] * (10 - first - 1)
        assert (out["responses"][0, first + 1:] == backend.pad_token_id).all()
        assert out["attention_mask"][0, -10:].tolist() == out["response_mask"][0].tolist()
        for i in range(1, len(PROMPTS)):  # other rows: cut at their own first stop token, if any
            full = free["responses"][i].tolist()
            n = full.index(stop_token) + 1 if stop_token in full else 10
            assert out["response_mask"][i].sum() == n and out["responses"][i, :n].tolist() == full[:n]
    ignored = generate(backend, 
        make_prompts(),
        SamplingConfig(max_response_length=10, do_sample=False, eos_token_ids=(stop_token,), ignore_eos=True),
    )
    assert torch.equal(ignored["responses"], free["responses"]) and (ignored["response_mask"] == 1).all()


def test_response_width_longest_or_fixed(backend):
    stop = generate(backend, make_prompts(), SamplingConfig(max_response_length=10, do_sample=False,
                                                           eos_token_ids=()))["responses"][0, 0].item()
    short = SamplingConfig(max_response_length=10, do_sample=False, eos_token_ids=(stop,),
                           pad_to_max_response_length=False)
    out = generate(backend, make_prompts([[5, 6, 7, 8]]), short)
    assert out["responses"].shape == (1, 1) and out["responses"].item() == stop
    fixed = generate(backend, make_prompts([[5, 6, 7, 8]]), SamplingConfig(
        max_response_length=10, do_sample=False, eos_token_ids=(stop,)))
    assert fixed["responses"].shape == (1, 10) and fixed["response_mask"].sum() == 1


def test_sampling_log_probs_use_the_filtered_distribution(backend, hf_reference_model):
    sampling = SamplingConfig(max_response_length=6, temperature=0.7, top_k=20, top_p=0.9, seed=11,
                              eos_token_ids=(), calculate_log_probs=True)
    out = generate(backend, make_prompts(), sampling)
    for i, prompt in enumerate(PROMPTS):
        expected = filtered_log_probs(hf_reference_model, out, i, len(prompt), sampling)
        assert torch.isfinite(expected).all()  # every sampled token survived top-k/top-p
        assert out["rollout_log_probs"][i].tolist() == pytest.approx(expected.tolist(), abs=1e-4)


def test_sampling_is_seeded_per_call_and_leaves_global_rng_alone(backend):
    sampling = SamplingConfig(max_response_length=8, temperature=1.0, seed=5, eos_token_ids=())
    fresh = build_backend(backend.config, model=backend.model)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first = generate(fresh, make_prompts(), sampling)["responses"]
    second = generate(fresh, make_prompts(), sampling)["responses"]
    assert torch.equal(torch.random.get_rng_state(), before)
    assert not torch.equal(first, second)  # the call index enters the seed: fresh samples each step
    # A new backend with the same seed replays the same sequence of calls.
    replay = build_backend(backend.config, model=backend.model)
    assert torch.equal(generate(replay, make_prompts(), sampling)["responses"], first)
    assert torch.equal(generate(replay, make_prompts(), sampling)["responses"], second)
    # What start_generate_call reads and writes is the protocol's: the call count is the default index.
    assert isinstance(replay, RolloutBackend) and replay.num_calls == 2
    assert replay.vocab_size == backend.model.config.vocab_size
    assert torch.equal(generate(replay, make_prompts(), sampling, call_index=1)["responses"], second)
    assert replay.num_calls == 3


def test_apply_sampling_filters_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    keep = lambda s: torch.isfinite(apply_sampling_filters(logits, s))[0].tolist()  # noqa: E731
    assert keep(SamplingConfig(top_k=2)) == [True, True, False, False, False]
    # Smallest prefix with mass >= 0.8: 0.5 + 0.2 + 0.15 = 0.85.
    assert keep(SamplingConfig(top_p=0.8)) == [True, True, True, False, False]
    assert keep(SamplingConfig(top_p=0.5)) == [True, False, False, False, False]
    assert keep(SamplingConfig(top_p=0.01)) == [True, False, False, False, False]
    scaled = apply_sampling_filters(logits, SamplingConfig(temperature=2.0))
    assert torch.allclose(scaled, logits / 2)
    assert torch.equal(apply_sampling_filters(logits, SamplingConfig(do_sample=False, top_k=1)), logits)


def test_load_weights_copies_by_name_and_rejects_unknown(tiny_model_dir, hf_reference_model):
    cfg = RolloutConfig(model_path=tiny_model_dir, backend="hf", device="cpu")
    fresh = build_backend(cfg)
    perturbed = {k: v + 0.05 for k, v in hf_reference_model.state_dict().items()}
    assert fresh.load_weights(iter(perturbed.items())) == len(perturbed)
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, perturbed[name]), name
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        fresh.load_weights([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight"):
        fresh.load_weights([("model.norm.weight", torch.zeros(3))])


def test_bad_prompts_are_rejected_with_row(backend):
    bad = make_prompts()
    bad["attention_mask"][2] = torch.tensor([1, 1, 1, 1, 1, 0])
    with pytest.raises(ValueError, match="row 2 is not left-padded"):
        generate(backend, bad)
    with pytest.raises(ValueError, match="row 0 holds token id 999"):
        generate(backend, make_prompts([[999]]))


@pytest.mark.parametrize("device, current, expected", [
    (torch.device("cuda", 3), 0, [3]),   # the model's own GPU, whatever the current device is
    (torch.device("cuda"), 2, [2]),      # a bare "cuda" is the current device, not GPU 0
    (torch.device("cpu"), 0, []),
])
def test_seeded_sampling_forks_the_rng_of_the_models_gpu(monkeypatch, device, current, expected):
    from ballast.workers.rollout.hf_backend import HFBackend

    forked = []

    @contextlib.contextmanager
    def fake_fork_rng(devices=None, **kw):
        forked.append(list(devices))
        yield

    monkeypatch.setattr(torch.random, "fork_rng", fake_fork_rng)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch, "manual_seed", lambda seed: None)  # no CUDA here to seed
    backend = HFBackend.__new__(HFBackend)
    backend.device, backend.config = device, RolloutConfig(model_path="/m", backend="hf")
    with backend._rng(7):
        pass
    assert forked == [expected]


def test_engines_and_calls_never_share_a_sampling_stream(backend):
    """The former scheme (engine seed + e * 2**16, call + k * 2**20) gave engine 16's call k the
    seed of engine 0's call k + 1: identical samples for different prompts' copies. Now disjoint."""
    import dataclasses

    from ballast.workers.actor_rollout_ref import _per_engine_seed

    sampling = SamplingConfig(max_response_length=8, temperature=1.0, seed=5, eos_token_ids=())
    config = dataclasses.replace(backend.config, sampling=sampling)
    engine0 = build_backend(_per_engine_seed(config, 0), model=backend.model)
    engine16 = build_backend(_per_engine_seed(config, 16), model=backend.model)
    assert engine16.config.engine_index == 16 and engine16.config.sampling.seed == 5
    prompts = make_prompts([[5, 6, 7, 8]] * 4)
    assert not torch.equal(generate(engine16, prompts, call_index=0)["responses"],
                           generate(engine0, prompts, call_index=1)["responses"])
    # ... while one engine still replays a call exactly (what resuming a run relies on)
    again = build_backend(_per_engine_seed(config, 16), model=backend.model)
    assert torch.equal(generate(again, prompts, call_index=0)["responses"],
                       generate(engine16, prompts, call_index=0)["responses"])
