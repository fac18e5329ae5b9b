"""The GGUF conversion of the real model: a plain HF Llama directory (no quantisation entry, tied
embeddings stored once), the chat tokenizer with <|im_end|> as eos, ids-only generation config, and
logits verified against the GGUF-loaded model (a check that sees a 1% change of one weight matrix)."""

import copy
import json

import pytest
import torch
from safetensors import safe_open

from ballast.models.from_gguf import VERIFY_ATOL, conversion_info, find_smollm2_gguf, max_logit_difference


@pytest.mark.slow
def test_converted_directory_is_a_plain_llama_with_the_chat_tokenizer_and_verified_logits(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == (30, 576, 9, 3, 49152, True)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.eos_token == "<|im_end|>" and cfg["eos_token_id"] == tok.eos_token_id == 2
    assert tok.pad_token_id is not None
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2 and len(tok("<|im_end|>", add_special_tokens=False)["input_ids"]) == 1
    # only token ids: vLLM would otherwise take sampling defaults from this file
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert set(generation) - {"transformers_version"} == {"bos_token_id", "eos_token_id", "pad_token_id"}
    # tied embeddings: one stored matrix, and the loaded lm_head is that matrix
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    info = conversion_info(smollm2_dir)
    assert info["gguf"] == str(find_smollm2_gguf().resolve())
    assert info["verify_max_abs_logit_diff"] <= VERIFY_ATOL["float32"] == info["verify_atol"]
    assert info["num_params"] == sum(p.numel() for p in model.parameters()) and 1.3e8 < info["num_params"] < 1.4e8
    # The verification compares real outputs: nudging one layer's weights moves the logits past the tolerance.
    other = copy.deepcopy(model).eval()
    ids = torch.tensor([tok("What is 2 + 2?")["input_ids"]])
    assert max_logit_difference(model.eval(), other, ids) <= VERIFY_ATOL["float32"]
    with torch.no_grad():
        other.model.layers[5].mlp.down_proj.weight.mul_(1.01)
    assert max_logit_difference(model, other, ids) > VERIFY_ATOL["float32"]
