"""Unsupported model features are clear errors, not wrong numbers."""

import pytest
import torch

from ballast.engine.attention import ballast_attention_forward


def test_sliding_window_attention_is_rejected_with_the_fix():
    q = k = v = torch.zeros(1, 2, 4, 32)
    with pytest.raises(ValueError, match=r"sliding-window attention \(window 16\).*use_sliding_window=false"):
        ballast_attention_forward(None, q, k, v, None, sliding_window=16)
