"""Loss aggregation: micro-batch shares add up to the whole-mini-batch loss for every mode and cut."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ballast.engine.losses import LOSS_AGG_MODES, GlobalNorm, agg_loss


def _whole_batch_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, horizon: float) -> float:
    """The mini-batch loss written directly from the definitions (no shares)."""
    lm, m = loss_mat.double().numpy(), mask.double().numpy()
    if mode == "token-mean":
        return float((lm * m).sum() / m.sum())
    if mode == "seq-mean-token-sum":
        return float((lm * m).sum(1).mean())
    if mode == "seq-mean-token-mean":
        return float(np.mean([(lm[b] * m[b]).sum() / max(m[b].sum(), 1) for b in range(len(m))]))
    return float((lm * m).sum(1).mean() / horizon)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 12),
    width=st.integers(1, 9),
    seed=st.integers(0, 10_000),
    num_parts=st.integers(1, 5),
)
def test_shares_over_any_cut_sum_to_the_whole_batch_loss(batch, width, seed, num_parts):
    gen = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, width, generator=gen) < 0.6).long()
    mask[0, 0] = 1  # at least one token in the mini-batch
    norm = GlobalNorm.local(mask)
    rng = np.random.default_rng(seed)
    order = rng.permutation(batch)
    cuts = np.array_split(order, min(num_parts, batch))
    for mode in LOSS_AGG_MODES:
        total = sum(float(agg_loss(loss_mat[c], mask[c], mode, norm)) for c in cuts)
        expected = _whole_batch_loss(loss_mat, mask, mode, horizon=width)
        assert math.isclose(total, expected, rel_tol=1e-12, abs_tol=1e-12), mode


def test_formulas_on_a_hand_example():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    norm = GlobalNorm(num_tokens=3, num_sequences=2, response_len=3)
    assert agg_loss(loss_mat, mask, "token-mean", norm).item() == pytest.approx((1 + 2 + 4) / 3)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum", norm).item() == pytest.approx((3 + 4) / 2)
    assert agg_loss(loss_mat, mask, "seq-mean-token-mean", norm).item() == pytest.approx((1.5 + 4) / 2)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", norm).item() == pytest.approx(7 / (2 * 3))
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", norm, loss_scale_factor=7).item() == pytest.approx(
        7 / (2 * 7)
    )


def test_masked_entries_do_not_leak_even_if_nan_free_values_are_huge():
    loss_mat = torch.tensor([[1.0, 1e30]])
    mask = torch.tensor([[1, 0]])
    for mode in LOSS_AGG_MODES:
        assert agg_loss(loss_mat, mask, mode, GlobalNorm.local(mask)).item() < 10


def test_empty_counts_give_zero_not_nan():
    loss_mat = torch.ones(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3)
    norm = GlobalNorm(num_tokens=0, num_sequences=0, response_len=3)
    for mode in LOSS_AGG_MODES:
        value = agg_loss(loss_mat, mask, mode, norm)
        assert value.item() == 0.0
        value.backward()
        assert torch.isfinite(loss_mat.grad).all()


def test_bad_arguments_are_named():
    norm = GlobalNorm(1, 1, 1)
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "mean", norm)
    with pytest.raises(ValueError, match=r"loss_mat shape \(1, 2\) != mask shape \(1, 1\)"):
        agg_loss(torch.zeros(1, 2), torch.ones(1, 1), "token-mean", norm)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        GlobalNorm(num_tokens=-1, num_sequences=1, response_len=1)
