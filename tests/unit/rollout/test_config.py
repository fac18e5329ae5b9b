"""RolloutConfig / SamplingConfig validation, special-token resolution and vLLM engine arguments."""

import json

import pytest

from ballast.workers.rollout.base import (
    RolloutConfig,
    SamplingConfig,
    check_sampling_for_engine,
    read_special_token_ids,
    resolve_special_tokens,
    stop_ids_for,
)
from ballast.workers.rollout.vllm_backend import engine_kwargs


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(max_response_length=0), "max_response_length=0"),
        (dict(top_k=0), "top_k=0"),
        (dict(top_k=-2), "top_k=-2"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(temperature=0.0), "temperature=0.0"),
        (dict(seed=1.5), "seed=1.5"),
        (dict(eos_token_ids=(-1,)), "eos_token_ids"),
        (dict(stop_token_ids=("a",)), "stop_token_ids"),
    ],
)
def test_sampling_config_rejects_bad_values_naming_them(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        SamplingConfig(**kwargs)


def test_sampling_config_normalises_ids_and_greedy_keeps_the_rest():
    cfg = SamplingConfig(eos_token_ids=[3, 4], stop_token_ids=7, temperature=0.5, top_k=5)
    assert cfg.eos_token_ids == (3, 4) and cfg.stop_token_ids == (7,)
    greedy = cfg.greedy()
    assert not greedy.do_sample and greedy.temperature == 0.5 and greedy.top_k == 5
    # Greedy decoding accepts temperature 0 (it is not used).
    SamplingConfig(do_sample=False, temperature=0.0)
    hash(cfg)  # frozen and hashable: usable as a cache key


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(backend="sglang"), "backend='sglang'"),
        (dict(device="tpu"), "device='tpu'"),
        (dict(dtype="int8"), "dtype='int8'"),
        (dict(max_model_len=0), "max_model_len=0"),
        (dict(kv_cache_memory_bytes=-5), "kv_cache_memory_bytes=-5"),
        (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization=0.0"),
        (dict(tensor_model_parallel_size=0), "tensor_model_parallel_size=0"),
        (dict(tensor_model_parallel_size=2, backend="hf"), "backend='hf'"),
        (dict(sleep_level=3), "sleep_level=3"),
        (dict(max_model_len=64, sampling=SamplingConfig(max_response_length=64)), "max_model_len=64"),
        (dict(tensor_model_parallel_size=2, sampling=SamplingConfig(seed=None)), "seed"),
        (dict(model_path=""), "model_path"),
    ],
)
def test_rollout_config_rejects_bad_values_naming_them(kwargs, fragment):
    kwargs = {"model_path": "/some/model", **kwargs}
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        RolloutConfig(**kwargs)


def test_tp_greedy_without_seed_is_allowed_but_sampling_is_not():
    cfg = RolloutConfig(model_path="/m", tensor_model_parallel_size=2)
    check_sampling_for_engine(cfg, SamplingConfig(seed=None, do_sample=False))
    with pytest.raises(ValueError, match="seed"):
        check_sampling_for_engine(cfg, SamplingConfig(seed=None))


def _write_model_dir(path, config, generation=None):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return str(path)


def test_special_tokens_come_from_generation_config_then_config_then_overrides(tmp_path):
    d = _write_model_dir(tmp_path / "a", {"eos_token_id": 5, "pad_token_id": 9}, {"eos_token_id": [5, 6]})
    assert read_special_token_ids(d) == ((5, 6), 9)
    assert resolve_special_tokens(RolloutConfig(model_path=d)) == ((5, 6), 9)
    cfg = RolloutConfig(model_path=d, pad_token_id=2, sampling=SamplingConfig(eos_token_ids=(7,)))
    assert resolve_special_tokens(cfg) == ((7,), 2)
    # No pad id anywhere: the first eos id pads (padding is always masked).
    d2 = _write_model_dir(tmp_path / "b", {"eos_token_id": 4})
    assert resolve_special_tokens(RolloutConfig(model_path=d2)) == ((4,), 4)


def test_stop_ids_merge_eos_and_stop_and_vanish_with_ignore_eos():
    assert stop_ids_for(SamplingConfig(stop_token_ids=(8, 3)), (3, 1)) == (3, 1, 8)
    assert stop_ids_for(SamplingConfig(eos_token_ids=(2,)), (3, 1)) == (2,)
    assert stop_ids_for(SamplingConfig(ignore_eos=True, stop_token_ids=(8,)), (3,)) == ()


def test_engine_kwargs_cpu_and_gpu(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    cpu = RolloutConfig(model_path="/m", device="cpu", max_model_len=256,
                        sampling=SamplingConfig(seed=3, max_response_length=64))
    kw = engine_kwargs(cpu, distributed=False)
    assert kw["dtype"] == "float32" and kw["kv_cache_memory_bytes"] == 2 << 30 and kw["seed"] == 3
    assert kw["max_model_len"] == 256 and "distributed_executor_backend" not in kw
    assert "gpu_memory_utilization" not in kw and kw["logprobs_mode"] == "processed_logprobs"
    explicit = RolloutConfig(model_path="/m", device="cpu", kv_cache_memory_bytes=1 << 24, tensor_model_parallel_size=2)
    kw = engine_kwargs(explicit, distributed=True)
    assert kw["kv_cache_memory_bytes"] == 1 << 24 and kw["distributed_executor_backend"] == "external_launcher"
    assert kw["tensor_parallel_size"] == 2
    gpu = RolloutConfig(model_path="/m", device="cuda", gpu_memory_utilization=0.4)
    kw = engine_kwargs(gpu, distributed=False)
    assert kw["dtype"] == "bfloat16" and kw["gpu_memory_utilization"] == 0.4 and kw["enable_sleep_mode"]
    assert "kv_cache_memory_bytes" not in kw
