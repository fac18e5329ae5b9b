"""GPU-only vLLM rollout checks (run by scripts/gpu_smoke.sh on a CUDA machine): sleep frees memory,
weight sync through the model's load_weights while asleep, wake_up, and the updated model is served;
after a level-2 sleep (weights discarded) the engine serves only once weights are loaded again.

The engine runs in bf16, so it is compared with a bf16 Hugging Face forward of the same weights. The
two bf16 computations differ by kernel order and fusion, not by precision, so their distance is
bounded by a small multiple of the bf16 reference's own distance from float32 (`_bf16_tolerance`).
"""

import copy
import dataclasses

import pytest
import torch
from tensordict import TensorDict

from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend, iter_full_tensors, load_weights
from testkit.rollout import generate

pytest.importorskip("vllm")
pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

SEQ = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 40, 41, 42, 43]


@pytest.fixture(scope="module")
def gpu_engine(vllm_tiny_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = RolloutConfig(
        model_path=vllm_tiny_model_dir, backend="vllm", device="cuda", dtype="bfloat16", max_model_len=128,
        # A fixed 64 MiB KV cache: a fraction of a large GPU would be millions of blocks for this model.
        gpu_memory_utilization=0.2, kv_cache_memory_bytes=64 << 20, free_cache_engine=True, sleep_level=1,
        sampling=SamplingConfig(max_response_length=16, do_sample=False, eos_token_ids=()),
    )
    backend = build_backend(cfg)
    yield backend
    backend.shutdown()


def _target_log_probs(model, seq):
    ids = torch.tensor([seq], device="cuda")
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].cpu()


def _bf16_reference(model, seq):
    """(bf16 log-probs, tolerance for a second bf16 implementation) of `model`'s weights."""
    fp32 = _target_log_probs(model, seq)
    bf16 = _target_log_probs(copy.deepcopy(model).to(torch.bfloat16), seq)
    own_error = (bf16 - fp32).abs().max().item()
    # vLLM's and HF's bf16 forwards each sit about own_error from float32, hence at most ~2x that from
    # each other; 3x plus a floor of 2e-2 (a few bf16 ulps of a log-prob near -7) leaves room for
    # kernel differences while staying far below the >0.1 gap a missing sync leaves.
    return bf16, max(3.0 * own_error, 2e-2)


def test_gpu_sleep_sync_wake_serves_the_updated_model(gpu_engine, vllm_tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(vllm_tiny_model_dir, dtype=torch.float32).cuda().eval()
    updated = copy.deepcopy(base)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, device="cuda"))
    target, tol = _bf16_reference(updated, SEQ)
    before = gpu_engine.prompt_log_probs([SEQ])[0]

    free_awake = torch.cuda.mem_get_info()[0]
    gpu_engine.sleep()
    assert torch.cuda.mem_get_info()[0] > free_awake  # the KV cache (and weights) were released
    with pytest.raises(RuntimeError, match="asleep"):
        generate(gpu_engine, TensorDict(input_ids=torch.tensor([[5]]), attention_mask=torch.tensor([[1]]),
                                       batch_size=[1]))
    count = load_weights(gpu_engine, iter_full_tensors(updated))
    gpu_engine.wake_up()
    assert count == len(updated.state_dict())
    after = gpu_engine.prompt_log_probs([SEQ])[0]
    # bf16 engine vs bf16 reference: the sync must close the gap the update opened, down to bf16 noise.
    gap_before = (before - target).abs().max().item()
    gap_after = (after - target).abs().max().item()
    assert gap_before > 0.1 and gap_after < tol, (gap_before, gap_after, tol)


def test_gpu_level2_sleep_serves_only_reloaded_weights(gpu_engine, vllm_tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(vllm_tiny_model_dir, dtype=torch.float32).cuda().eval()
    target, tol = _bf16_reference(base, SEQ)
    # The same engine (one sleep-mode engine per process), now sleeping at level 2.
    gpu_engine.config = dataclasses.replace(gpu_engine.config, sleep_level=2)
    gpu_engine.sleep()
    assert gpu_engine.needs_weights
    with pytest.raises(RuntimeError, match="level-2 sleep"):
        gpu_engine.wake_up()  # vLLM would map uninitialised memory for the weights
    load_weights(gpu_engine, iter_full_tensors(base))
    gpu_engine.wake_up()
    served = gpu_engine.prompt_log_probs([SEQ])[0]
    gap = (served - target).abs().max().item()
    assert gap < tol, (gap, tol)
