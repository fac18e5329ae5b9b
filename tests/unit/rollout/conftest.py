"""Fixtures for the rollout unit tests: one tiny random Qwen2 directory and its HF model per session."""

import pytest
import torch

from testkit.models import build_tiny_qwen2


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_qwen2(str(tmp_path_factory.mktemp("tiny_qwen2")))


@pytest.fixture(scope="session")
def hf_reference_model(tiny_model_dir):
    """A separate copy of the tiny model for computing reference log-probs (never mutated)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
