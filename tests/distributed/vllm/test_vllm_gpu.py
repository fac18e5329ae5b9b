"""GPU-only vLLM rollout checks (run by scripts/gpu_smoke.sh on a CUDA machine): sleep frees memory,
weight sync through the model's load_weights while asleep, wake_up, and the updated model is served."""

import copy

import pytest
import torch
from tensordict import TensorDict

from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend, iter_full_tensors, load_weights

pytest.importorskip("vllm")
pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

SEQ = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 40, 41, 42, 43]


@pytest.fixture(scope="module")
def gpu_engine(vllm_tiny_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = RolloutConfig(
        model_path=vllm_tiny_model_dir, backend="vllm", device="cuda", dtype="bfloat16", max_model_len=128,
        gpu_memory_utilization=0.2, free_cache_engine=True, sleep_level=1,
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


def test_gpu_sleep_sync_wake_serves_the_updated_model(gpu_engine, vllm_tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(vllm_tiny_model_dir, dtype=torch.float32).cuda().eval()
    updated = copy.deepcopy(base)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, device="cuda"))
    target = _target_log_probs(updated, SEQ)
    before = gpu_engine.prompt_log_probs([SEQ])[0]

    free_awake = torch.cuda.mem_get_info()[0]
    gpu_engine.sleep()
    assert torch.cuda.mem_get_info()[0] > free_awake  # the KV cache (and weights) were released
    with pytest.raises(RuntimeError, match="asleep"):
        gpu_engine.generate(TensorDict(input_ids=torch.tensor([[5]]), attention_mask=torch.tensor([[1]]),
                                       batch_size=[1]))
    count = load_weights(gpu_engine, iter_full_tensors(updated))
    gpu_engine.wake_up()
    assert count == len(updated.state_dict())
    after = gpu_engine.prompt_log_probs([SEQ])[0]
    # bf16 engine vs fp32 reference: the sync must close most of the gap the update opened.
    gap_before = (before - target).abs().max().item()
    gap_after = (after - target).abs().max().item()
    assert gap_before > 0.1 and gap_after < 0.05, (gap_before, gap_after)
