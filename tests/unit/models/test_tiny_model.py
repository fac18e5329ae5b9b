"""The tiny model builder: loads with AutoModelForCausalLM, finite logits, ids consistent with the
tokenizer, presets, seeds, validation of overrides, and the CLI."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ballast.models import PRESETS, build_info, build_tiny_model
from ballast.models import tiny as tiny_module
from ballast.models.tiny import resolve_settings


def test_model_loads_and_gives_finite_logits(built_dir):
    tok = AutoTokenizer.from_pretrained(built_dir)
    model = AutoModelForCausalLM.from_pretrained(built_dir).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    text = tok.apply_chat_template([{"role": "user", "content": "Repeat the symbol # exactly 3 times."}],
                                   tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()
    # random init, not a degenerate constant: positions and vocab entries differ
    assert logits.std() > 0


def test_config_ids_come_from_the_tokenizer(built_dir):
    tok = AutoTokenizer.from_pretrained(built_dir)
    cfg = AutoConfig.from_pretrained(built_dir)
    assert cfg.model_type == "qwen2"
    assert cfg.vocab_size == len(tok)
    assert cfg.eos_token_id == tok.eos_token_id
    assert cfg.pad_token_id == tok.pad_token_id
    assert cfg.bos_token_id == tok.pad_token_id  # Qwen convention: <|endoftext|>
    assert cfg.hidden_size // cfg.num_attention_heads >= 32
    generation = json.loads((built_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_token_id
    assert generation["pad_token_id"] == tok.pad_token_id
    # vLLM takes sampling defaults from this file; RL must sample the raw policy.
    sampling_keys = {"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "do_sample", "max_new_tokens"}
    assert not sampling_keys & set(generation)


def test_build_info_records_params_and_vocab(built_dir):
    info = build_info(built_dir)
    model = AutoModelForCausalLM.from_pretrained(built_dir)
    assert info["num_params"] == sum(p.numel() for p in model.parameters())
    assert info["vocab_size"] == AutoConfig.from_pretrained(built_dir).vocab_size
    assert info["preset"] == "tiny" and info["seed"] == 0


def test_same_seed_same_weights_other_seed_other_weights(built_dir, tmp_path):
    again = load_file(build_tiny_model(tmp_path / "again", seed=0) / "model.safetensors")
    other = load_file(build_tiny_model(tmp_path / "other", seed=1) / "model.safetensors")
    first = load_file(built_dir / "model.safetensors")
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first if first[k].std() > 0)


def test_build_does_not_move_the_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_small_preset_has_a_few_million_params(tmp_path):
    path = build_tiny_model(tmp_path / "small", preset="small", num_hidden_layers=4)
    info = build_info(path)
    assert 2_000_000 <= info["num_params"] <= 8_000_000
    assert info["tie_word_embeddings"] is False
    assert AutoConfig.from_pretrained(path).num_hidden_layers == 4


def test_every_preset_has_head_dim_at_least_32():
    for name, preset in PRESETS.items():
        assert preset["hidden_size"] // preset["num_attention_heads"] >= 32, name
        assert preset["num_attention_heads"] % preset["num_key_value_heads"] == 0, name


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(preset="huge"), "unknown preset 'huge'"),
        (dict(hidden_sise=64), r"unknown model overrides \['hidden_sise'\]"),
        (dict(hidden_size=128, num_attention_heads=8), "head_dim .* 128/8 = 16 < 32"),
        (dict(hidden_size=100, num_attention_heads=3), "hidden_size=100 is not divisible by num_attention_heads=3"),
        (dict(num_attention_heads=4, num_key_value_heads=3), "num_attention_heads=4 is not divisible by num_key_value_heads=3"),
        (dict(tokenizer_vocab_size=100), "vocab_size=100 must exceed 259"),
    ],
)
def test_invalid_settings_are_clear_errors(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_tiny_model(tmp_path / "bad", **kwargs)


def test_settings_change_the_cache_key():
    base = tiny_module.settings_hash(resolve_settings("tiny"))
    assert base == tiny_module.settings_hash(resolve_settings("tiny"))
    assert base != tiny_module.settings_hash(resolve_settings("tiny", seed=1))
    assert base != tiny_module.settings_hash(resolve_settings("tiny", num_hidden_layers=3))


def test_cli_builds_and_prints_what_it_built(tmp_path, capsys):
    out = tmp_path / "cli"
    assert tiny_module.main(["--out", str(out), "--preset", "tiny", "--seed", "2"]) == 0
    printed = capsys.readouterr().out
    info = build_info(out)
    assert f"params={info['num_params']:,}" in printed
    assert f"vocab={info['vocab_size']}" in printed
    assert str(out.resolve()) in printed
    assert info["seed"] == 2
