"""benchmarks/cpu_bounds.py times the GEMMs of a model's real layer shapes and sizes AdamW's traffic from
its parameter count: both must be the model's own, or the bounds it reports are about another model.
benchmarks/machine.py records the CPU of every result from the first core's /proc/cpuinfo fields."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


cpu_bounds = _load("cpu_bounds")
machine = _load("machine")


@pytest.mark.parametrize("tied", [True, False])
def test_layer_shapes_are_the_models_linear_weights_and_params_all_but_its_biases(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    from ballast.models import build_tiny_model

    path = build_tiny_model(tmp_path / "m", num_key_value_heads=2, tie_word_embeddings=tied)
    shapes, layers, params = cpu_bounds.layer_shapes(str(path))
    model = AutoModelForCausalLM.from_pretrained(path)
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    assert layers == len(model.model.layers)
    for layer in model.model.layers:
        for short, name in names.items():
            assert tuple(layer.get_submodule(name).weight.shape) == shapes[short], name
    assert tuple(model.lm_head.weight.shape) == shapes["lm_head"]
    biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))
    assert params == sum(p.numel() for p in model.parameters()) - biases  # tied weights counted once


def test_cpu_fields_come_from_the_first_core_only(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: First CPU\nflags\t\t: fpu avx2 avx512f amx_bf16\n\n"
                    "processor\t: 1\nmodel name\t: Second CPU\nflags\t\t: fpu sse2\n\n")
    fields = machine._cpuinfo_fields(str(info))
    assert fields["model name"] == "First CPU"
    assert fields["flags"].split() == ["fpu", "avx2", "avx512f", "amx_bf16"]
    assert machine._cpuinfo_fields(str(tmp_path / "absent")) == {}


def test_cpu_info_names_only_known_instruction_sets():
    info = machine.cpu_info()
    assert info["model_name"] and info["cores"] >= 1
    assert set(info["isa"]) <= set(machine.ISA_FLAGS)
    assert info["torch"] == torch.__version__
