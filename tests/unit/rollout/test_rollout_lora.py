"""Serving a LoRA adapter: the HF backend takes an adapter like vLLM does (only the adapter moves, the
base weights stay), the vLLM engine settings for LoRA, and the choice of what a weight sync moves."""

import pytest
import torch

from ballast.engine.config import SpecError
from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend
from ballast.workers.rollout.vllm_backend import engine_kwargs
from ballast.workers.rollout.vllm_lora import VLLM_LORA_RANKS, lora_engine_kwargs, vllm_lora_rank
from ballast.workers.rollout.weight_sync import SyncMode, sync_mode
from testkit.lora import trained_adapter

SEQ = [3, 9, 27, 81, 14, 5, 200, 17, 64, 8]


def _trained_adapter(model_dir, rank=4, seed=0):
    """A PEFT model with a non-zero adapter (as after some training), its adapter tensors and config."""
    model, adapter, tensors = trained_adapter(model_dir, rank, seed)
    return model, tensors, adapter.config_dict()


def _log_probs(model, seq=SEQ):
    ids = torch.tensor([seq])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1].float(), -1)
    return lp.gather(1, ids[0, 1:, None])[:, 0]


@pytest.fixture()
def hf_backend(tiny_model_dir):
    return build_backend(RolloutConfig(model_path=tiny_model_dir, backend="hf", device="cpu",
                                       sampling=SamplingConfig(max_response_length=4, do_sample=False)))


def test_hf_backend_serves_each_new_adapter_version(hf_backend, tiny_model_dir, hf_reference_model):
    assert hf_backend.serves_adapters and sync_mode(True, hf_backend) is SyncMode.ADAPTER
    base = hf_backend.prompt_log_probs([SEQ])[0]
    assert torch.allclose(base, _log_probs(hf_reference_model), atol=1e-5)
    for seed in (0, 1):  # a second version replaces the first in place
        trained, tensors, config = _trained_adapter(tiny_model_dir, seed=seed)
        assert hf_backend.load_adapter(tensors.items(), config) == len(tensors)
        served = hf_backend.prompt_log_probs([SEQ])[0]
        assert torch.allclose(served, _log_probs(trained), atol=1e-5)
        assert (served - base).abs().mean() > 1e-2


def test_hf_backend_refuses_an_adapter_of_another_shape(hf_backend, tiny_model_dir):
    _, tensors, config = _trained_adapter(tiny_model_dir, rank=4)
    hf_backend.load_adapter(tensors.items(), config)
    _, other, _ = _trained_adapter(tiny_model_dir, rank=2)
    with pytest.raises(ValueError, match="does not match the served adapter"):
        hf_backend.load_adapter(other.items(), config)
    with pytest.raises(ValueError, match="lacks"):
        hf_backend.load_adapter(list(tensors.items())[:-2], config)


def test_vllm_lora_ranks_and_engine_kwargs():
    assert vllm_lora_rank(1) == 1 and vllm_lora_rank(2) == 8 and vllm_lora_rank(16) == 16
    assert vllm_lora_rank(300) == 320 and vllm_lora_rank(512) == 512 and vllm_lora_rank(513) is None
    assert lora_engine_kwargs(12) == dict(enable_lora=True, max_lora_rank=16, max_loras=1)
    with pytest.raises(ValueError, match="exceeds"):
        lora_engine_kwargs(VLLM_LORA_RANKS[-1] + 1)
    cfg = RolloutConfig(model_path="/m", device="cpu", max_lora_rank=1)
    assert engine_kwargs(cfg, distributed=False, serve_lora=True)["max_lora_rank"] == 1
    assert "enable_lora" not in engine_kwargs(cfg, distributed=False)  # fell back: plain engine
    with pytest.raises(SpecError) as err:
        RolloutConfig(model_path="/m", max_lora_rank=0)
    assert err.value.field == "max_lora_rank"


def test_sync_mode_choice():
    class Plain:
        serves_adapters = False

    assert sync_mode(False, Plain()) is SyncMode.FULL
    assert sync_mode(True, Plain()) is SyncMode.MERGED
