"""A LoRA adapter as after some training, for the rollout tests that load adapters into an engine."""

import torch
from transformers import AutoModelForCausalLM

from ballast.engine.config import LoraSpec
from ballast.engine.lora import adapter_state, attach_adapter


def trained_adapter(model_dir, rank, seed, targets="all-linear", b_seed=None):
    """(PEFT model, its adapter, the adapter's tensors) with every lora_B drawn from N(0, 0.3^2) under
    `b_seed` (default seed + 1), so the adapter has moved off the base model (PEFT starts B at zero)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    adapter = attach_adapter(model, LoraSpec(rank=rank, alpha=2 * rank, target_modules=targets), "actor", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1 if b_seed is None else b_seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model, adapter, {n: t.clone() for n, t in adapter_state(model.state_dict().items())}
