"""LoRA on a plain (unsharded) model: the spec's rules, what `attach_adapter` trains, and the three views
of the adapted state (merged, base, adapter) checked against PEFT's own merge, files and forward."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from ballast.engine.config import EngineConfig, LoraSpec, SpecError
from ballast.engine.lora import (
    adapter_state,
    attach_adapter,
    base_state,
    check_targets,
    is_adapter_param,
    merged_state,
    save_adapter,
)

IDS = torch.tensor([[3, 17, 42, 5, 99, 12, 7, 64, 31]])


def _lm(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _randomise_b(model, seed=1):
    """B starts at zero (the adapted model equals the base); give it values so the adapter matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _log_probs(model, ids=IDS):
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]


@pytest.mark.parametrize("kwargs, field", [
    (dict(rank=-1), "rank"), (dict(rank=True), "rank"), (dict(rank=4, alpha=0), "alpha"),
    (dict(rank=4, target_modules=""), "target_modules"), (dict(rank=4, target_modules=[]), "target_modules"),
    (dict(rank=4, exclude_modules=[""]), "exclude_modules"), (dict(adapter_path="/nowhere"), "adapter_path"),
])
def test_spec_errors_name_the_field(kwargs, field):
    with pytest.raises(SpecError) as err:
        LoraSpec(**kwargs)
    assert err.value.field == field


def test_spec_enabled_and_the_reference_role_refuses_an_adapter(tmp_path):
    assert not LoraSpec().enabled and LoraSpec(rank=1).enabled
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")  # its existence is checked; PEFT reads it
    assert LoraSpec(adapter_path=str(tmp_path)).enabled  # verl: an adapter path turns LoRA on with rank 0
    assert LoraSpec(rank=4, target_modules=["q_proj", "v_proj"]).target_modules == ("q_proj", "v_proj")
    with pytest.raises(SpecError, match="reference"):
        EngineConfig(model_path="/m", role="ref", lora=LoraSpec(rank=4))


def test_attach_freezes_the_base_and_starts_as_the_base_model(tiny_lm_dir):
    model = _lm(tiny_lm_dir)
    before = _log_probs(model)
    adapter = attach_adapter(model, LoraSpec(rank=4, alpha=8), "actor", seed=3)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_param(n) for n in trainable)
    assert not any(is_adapter_param(n) for n, p in model.named_parameters() if not p.requires_grad)
    # all-linear: every projection of every layer, not the output head
    assert len(adapter.scalings) == 7 * model.config.num_hidden_layers
    assert not any("lm_head" in n for n in adapter.scalings)
    assert set(adapter.scalings.values()) == {2.0} and adapter.max_rank == 4
    assert torch.equal(_log_probs(model), before)  # B = 0
    # the same seed gives the same A on every rank (FSDP2 broadcasts nothing)
    twin = _lm(tiny_lm_dir)
    attach_adapter(twin, LoraSpec(rank=4, alpha=8), "actor", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


def test_exclude_and_non_linear_targets(tiny_lm_dir):
    adapter = attach_adapter(_lm(tiny_lm_dir), LoraSpec(rank=2, exclude_modules=["o_proj", "down_proj"]), "actor")
    assert not any(n.endswith(("o_proj", "down_proj")) for n in adapter.scalings)
    with pytest.raises(ValueError, match="not a linear layer"):
        attach_adapter(_lm(tiny_lm_dir), LoraSpec(rank=2, target_modules=["embed_tokens", "q_proj"]), "actor")


def test_targets_that_adapt_nothing_or_no_linear_layer_are_found_on_a_weightless_model(tiny_lm_dir, tmp_path):
    check_targets(tiny_lm_dir, LoraSpec(rank=2), "actor")
    check_targets(tiny_lm_dir, LoraSpec(rank=2, target_modules=["q_proj", "v_proj"]), "critic")
    with pytest.raises(SpecError, match=r"Target modules \{'qkv'\} not found in the base model") as err:
        check_targets(tiny_lm_dir, LoraSpec(rank=2, target_modules=["qkv"]), "actor")
    assert err.value.field == "target_modules" and tiny_lm_dir in str(err.value)
    with pytest.raises(SpecError, match="not a linear layer"):
        check_targets(tiny_lm_dir, LoraSpec(rank=2, target_modules=["embed_tokens", "q_proj"]), "actor")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "target_modules": ["wq"]}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(SpecError, match=r"Target modules \{'wq'\} not found") as err:
        check_targets(tiny_lm_dir, LoraSpec(adapter_path=str(tmp_path)), "actor")
    assert err.value.field == "adapter_path"


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_an_adapter_bin_that_is_more_than_tensors_is_refused_naming_it(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    weights = tmp_path / "adapter_model.bin"
    torch.save({"base_model.model.q_proj.lora_A.weight": torch.zeros(2, 4)}, weights)
    assert LoraSpec(adapter_path=str(tmp_path)).enabled  # tensors only: PEFT's weights_only load takes it
    marker = tmp_path / "payload_ran"
    torch.save({"lora_A": _Payload(str(marker))}, weights)
    with pytest.raises(SpecError, match=rf"{weights}: refused by torch\.load\(weights_only=True\)") as err:
        LoraSpec(adapter_path=str(tmp_path))
    assert err.value.field == "adapter_path" and not marker.exists()
    weights.unlink()
    with pytest.raises(SpecError, match="holds neither adapter_model.safetensors nor adapter_model.bin"):
        LoraSpec(adapter_path=str(tmp_path))


def test_merged_state_equals_peft_merge_and_the_switch_runs_the_base(tiny_lm_dir):
    base = _lm(tiny_lm_dir)
    base_sd = {k: v.clone() for k, v in base.state_dict().items()}
    base_lp = _log_probs(base)
    model = _lm(tiny_lm_dir)
    adapter = attach_adapter(model, LoraSpec(rank=4, alpha=16, target_modules=["q_proj", "up_proj", "o_proj"]), "actor")
    _randomise_b(model)
    adapted_lp = _log_probs(model)
    assert (adapted_lp - base_lp).abs().max() > 1e-2
    with adapter.disabled():
        assert torch.allclose(_log_probs(model), base_lp, atol=1e-6)
    assert torch.equal(_log_probs(model), adapted_lp)  # switched back on
    merged = dict(merged_state(model.state_dict().items(), adapter.scalings))
    assert merged.keys() == base_sd.keys()
    plain = _lm(tiny_lm_dir)
    plain.load_state_dict(merged, strict=True)
    assert torch.allclose(_log_probs(plain), adapted_lp, atol=1e-5)
    peft_merged = adapter.peft_model.merge_and_unload().state_dict()
    assert all(torch.allclose(merged[k], peft_merged[k], atol=1e-6) for k in merged)


def test_base_and_adapter_views(tiny_lm_dir):
    from peft import get_peft_model_state_dict

    original = _lm(tiny_lm_dir).state_dict()
    model = _lm(tiny_lm_dir)
    adapter = attach_adapter(model, LoraSpec(rank=3), "actor")
    _randomise_b(model)
    base = dict(base_state(model.state_dict().items()))
    assert base.keys() == original.keys() and all(torch.equal(base[k], original[k]) for k in base)
    ours = dict(adapter_state(model.state_dict().items()))
    theirs = get_peft_model_state_dict(adapter.peft_model)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_saved_adapter_loads_with_peft_and_resumes_training(tiny_lm_dir, tmp_path):
    from peft import PeftModel

    model = _lm(tiny_lm_dir)
    adapter = attach_adapter(model, LoraSpec(rank=4, alpha=8, exclude_modules=["gate_proj"]), "actor")
    _randomise_b(model)
    save_adapter(str(tmp_path), model.state_dict().items(), adapter)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    loaded = PeftModel.from_pretrained(_lm(tiny_lm_dir), str(tmp_path))
    assert torch.allclose(_log_probs(loaded), _log_probs(model), atol=1e-6)
    # lora_adapter_path: training continues from the saved adapter, its own config deciding
    again = _lm(tiny_lm_dir)
    resumed = attach_adapter(again, LoraSpec(adapter_path=str(tmp_path)), "actor")
    assert resumed.scalings == adapter.scalings
    assert torch.allclose(_log_probs(again), _log_probs(model), atol=1e-6)
    assert any(p.requires_grad for p in again.parameters())


def test_critic_trains_its_value_head_whole(tiny_lm_dir):
    config = AutoConfig.from_pretrained(tiny_lm_dir)
    config.num_labels = 1
    critic = AutoModelForTokenClassification.from_pretrained(tiny_lm_dir, config=config, dtype=torch.float32)
    adapter = attach_adapter(critic, LoraSpec(rank=2), "critic")
    assert adapter.head == "score" and "score" not in adapter.scalings
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert {"score.modules_to_save.default.weight", "score.modules_to_save.default.bias"} <= trainable
    with torch.no_grad():
        critic.score.modules_to_save["default"].weight.add_(1.0)
    merged = dict(merged_state(critic.state_dict().items(), adapter.scalings))
    assert "score.weight" in merged and not any("original_module" in k for k in merged)
    assert torch.equal(merged["score.weight"], critic.score.modules_to_save["default"].weight)
    names = dict(adapter_state(critic.state_dict().items()))
    assert "base_model.model.score.weight" in names


def test_fused_layers_equal_pefts_forward_and_gradients(tiny_lm_dir, monkeypatch):
    from peft.tuners.lora.layer import Linear as PeftLinear

    from ballast.engine.lora import fused_linear_class

    model = _lm(tiny_lm_dir)
    adapter = attach_adapter(model, LoraSpec(rank=4, alpha=8), "actor", seed=2)
    _randomise_b(model)
    layers = [m for m in model.modules() if isinstance(m, PeftLinear)]
    assert layers and all(type(m) is fused_linear_class() for m in layers)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=IDS, use_cache=False).logits.float()
        loss = torch.log_softmax(logits, -1).gather(-1, IDS[..., None]).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    fused_loss, fused_grads = loss_and_grads()
    monkeypatch.setattr(fused_linear_class(), "forward", PeftLinear.forward)
    peft_loss, peft_grads = loss_and_grads()
    assert torch.allclose(fused_loss, peft_loss, atol=1e-6)
    assert all(torch.allclose(fused_grads[n], peft_grads[n], atol=1e-6, rtol=1e-5) for n in peft_grads)
    monkeypatch.undo()
    with adapter.disabled():  # the switch takes PEFT's path: the base model
        base = _log_probs(model)
    assert torch.allclose(base, _log_probs(_lm(tiny_lm_dir)), atol=1e-6)
