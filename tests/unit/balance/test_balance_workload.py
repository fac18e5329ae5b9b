"""Workload models: exact values, int64/float64 safety for 1M-token sequences, HF config parsing."""

import numpy as np
import pytest

from ballast.balance import VERL_LINEAR_COEFF, FlopsModel, workload_costs

QWEN25_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 intermediate_size=18944, vocab_size=152064)


def test_tokens_and_verl_models_exact():
    lengths = [0, 1, 100, 4096]
    assert workload_costs(lengths, "tokens").tolist() == [0.0, 1.0, 100.0, 4096.0]
    expected = [VERL_LINEAR_COEFF * x + x * x for x in lengths]
    assert workload_costs(lengths, "verl").tolist() == expected


def test_one_million_tokens_do_not_overflow_from_int32_input():
    lengths = np.array([1_000_000, 2_000_000], dtype=np.int32)
    verl = workload_costs(lengths, "verl")
    assert verl.dtype == np.float64
    assert verl.tolist() == [24576 * 10**6 + 10**12, 24576 * 2 * 10**6 + 4 * 10**12]
    flops = workload_costs(lengths, FlopsModel.from_hf_config(QWEN25_7B))
    assert np.all(np.isfinite(flops)) and np.all(flops > 0)
    # Quadratic attention term: doubling the length more than doubles the cost.
    assert flops[1] > 2 * flops[0]


def test_flops_model_matches_hand_count():
    model = FlopsModel(hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=16, vocab_size=10)
    head_dim = 4
    proj = 2 * 8 * (2 * head_dim + 2 * 1 * head_dim) + 2 * (2 * head_dim) * 8  # q,k,v in; o out
    mlp = 2 * 3 * 8 * 16
    linear = 2 * (proj + mlp) + 2 * 8 * 10
    pair = 4 * 2 * 2 * head_dim
    for length in (1, 5, 37):
        expected = length * linear + pair * length * (length + 1) / 2
        assert workload_costs([length], model)[0] == pytest.approx(expected, rel=1e-12)


def test_from_hf_config_dict_and_transformers_object_agree():
    transformers = pytest.importorskip("transformers")
    from_dict = FlopsModel.from_hf_config(QWEN25_7B)
    from_obj = FlopsModel.from_hf_config(transformers.Qwen2Config(**QWEN25_7B))
    assert from_dict == from_obj
    assert from_dict.num_kv_heads == 4 and from_dict.resolved_head_dim == 128


def test_from_hf_config_defaults_and_nested_text_config():
    cfg = {k: v for k, v in QWEN25_7B.items() if k != "num_key_value_heads"}
    assert FlopsModel.from_hf_config(cfg).num_kv_heads == 28  # MHA when KV heads are not given
    assert FlopsModel.from_hf_config({"text_config": QWEN25_7B}) == FlopsModel.from_hf_config(QWEN25_7B)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="intermediate_size"):
        FlopsModel.from_hf_config({k: v for k, v in QWEN25_7B.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="num_kv_heads"):
        FlopsModel(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=3, intermediate_size=8, vocab_size=8)
    with pytest.raises(ValueError, match="unknown workload"):
        workload_costs([1], "quadratic")
    with pytest.raises(ValueError, match="-3 at index 1"):
        workload_costs([1, -3], "tokens")
    with pytest.raises(ValueError, match="whole numbers"):
        workload_costs([1.5], "tokens")
