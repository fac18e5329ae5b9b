"""Unsupported model features are clear errors, not wrong numbers."""

import pytest
import torch

from ballast.engine.attention import ballast_attention_forward


def test_sliding_window_attention_is_rejected_with_the_fix():
    q = k = v = torch.zeros(1, 2, 4, 32)
    with pytest.raises(ValueError, match=r"sliding-window attention \(window 16\).*use_sliding_window=false"):
        ballast_attention_forward(None, q, k, v, None, sliding_window=16)


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_fsdp_size_must_be_minus_one_or_a_positive_int(value):
    from ballast.engine import EngineConfig
    from ballast.engine.config import SpecError

    with pytest.raises(SpecError, match=f"fsdp_size must be -1 or an int >= 1, got {value!r}"):
        EngineConfig(model_path="/m", fsdp_size=value)


def test_shard_size_follows_verls_fsdp_size_rule():
    from ballast.engine.dist import resolve_shard_size

    assert [resolve_shard_size(k, 8) for k in (-1, 8, 16, 4, 2, 1)] == [8, 8, 8, 4, 2, 1]
    with pytest.raises(ValueError, match="fsdp_size=3 must divide the world size 8"):
        resolve_shard_size(3, 8)
