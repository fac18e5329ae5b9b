"""Chunked log-probs/entropy (hand-written backward) equal the direct full-vocab computation in float64,
values and gradients, whichever outputs the loss uses."""

import pytest
import torch

from ballast.engine.logprob import log_probs_and_entropy


def _direct(logits, labels, temperature):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    lp = logp.gather(-1, labels[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_grads_match_direct_computation(chunk, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(11, 37, generator=gen, requires_grad=True)
    labels = torch.randint(0, 37, (11,), generator=gen)
    weights = torch.randn(11, generator=gen)
    lp, ent = log_probs_and_entropy(logits, labels, temperature, calculate_entropy=True, chunk_tokens=chunk)
    ref_lp, ref_ent = _direct(logits, labels, temperature)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    (lp * weights + 0.3 * ent).sum().backward()
    got = logits.grad.clone()
    logits.grad = None
    ((ref_lp * weights.double()) + 0.3 * ref_ent).sum().backward()
    torch.testing.assert_close(got.double(), logits.grad.double(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("use", ["log_probs", "entropy", "both"])
def test_grads_when_the_loss_uses_one_output_or_both(use):
    """More tokens than a block (several blocks), a temperature, and the output the loss ignores
    contributing nothing (its gradient is skipped, not zero-filled)."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(41, 53, generator=gen) * 4).requires_grad_()
    labels = torch.randint(0, 53, (41,), generator=gen)
    weights = torch.randn(41, generator=gen)
    lp, ent = log_probs_and_entropy(logits, labels, 0.7, calculate_entropy=True)
    ref_lp, ref_ent = _direct(logits, labels, 0.7)
    coeff = {"log_probs": (1.0, 0.0), "entropy": (0.0, 1.0), "both": (1.0, -0.5)}[use]
    loss = sum(c * (x * weights).sum() for c, x in zip(coeff, (lp, ent)) if c)
    loss.backward()
    got = logits.grad.clone()
    logits.grad = None
    sum(c * (x * weights.double()).sum() for c, x in zip(coeff, (ref_lp, ref_ent)) if c).backward()
    # z spans about +-20 here: float32 rounding of E_p[z] - z costs a few 1e-6 per unit weight
    torch.testing.assert_close(got.double(), logits.grad.double(), atol=3e-5, rtol=0)


def test_widely_spread_logits_whose_probabilities_underflow():
    """A real model's logits over a large vocabulary put most probabilities below float32's normal
    range: values and gradients stay those of the float64 computation."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(20, 3000, generator=gen) * 30
    logits[:, 7] += 150.0
    logits.requires_grad_()
    labels = torch.randint(0, 3000, (20,), generator=gen)
    labels[:5] = 7
    lp, ent = log_probs_and_entropy(logits, labels, calculate_entropy=True)
    ref_lp, ref_ent = _direct(logits, labels, 1.0)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-4, rtol=0)
    (lp.sum() + ent.sum()).backward()
    got = logits.grad.clone()
    logits.grad = None
    (ref_lp.sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(got.double(), logits.grad.double(), atol=1e-5, rtol=0)


def test_bf16_logits_get_a_bf16_gradient():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(19, 40, generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, 40, (19,), generator=gen)
    lp, _ = log_probs_and_entropy(logits, labels, calculate_entropy=False)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = logits.detach().float().requires_grad_()
    _direct(ref, labels, 1.0)[0].sum().backward()
    torch.testing.assert_close(logits.grad.float(), ref.grad.float(), atol=1e-2, rtol=0)


def test_bf16_logits_are_upcast_per_chunk():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 20, generator=gen).bfloat16()
    labels = torch.randint(0, 20, (6,), generator=gen)
    lp, ent = log_probs_and_entropy(logits, labels, calculate_entropy=False, chunk_tokens=2)
    assert ent is None and lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), _direct(logits.float(), labels, 1.0)[0], atol=1e-5, rtol=0)


def test_empty_input_stays_connected_to_the_graph():
    logits = torch.randn(0, 5, requires_grad=True)
    lp, ent = log_probs_and_entropy(logits, torch.zeros(0, dtype=torch.long), calculate_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,) and lp.requires_grad
    lp.sum().backward()
    assert logits.grad.shape == (0, 5)


def test_bad_inputs():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        log_probs_and_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match=r"need logits \(N, V\) and labels \(N,\)"):
        log_probs_and_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
