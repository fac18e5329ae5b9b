"""Single-process model paths: packed == padded == per-sample reference, attention routing."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from ballast.engine.attention import (
    ATTN_IMPLEMENTATION,
    PackedAttentionContext,
    ballast_attention_forward,
    varlen_causal_attention,
)
from ballast.engine.forward import ForwardOptions, forward_micro_batch
from ballast.engine.model import load_model
from testkit.engine import make_rl_batch

PROMPTS = [3, 9, 1, 14, 6]
RESPONSES = [5, 0, 11, 2, 7]


def _reference(model_dir, data, temperature):
    """Each sample alone, no padding, plain sdpa model, full-vocab log_softmax."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    R = data["responses"].shape[1]
    P = data["input_ids"].shape[1] - R
    lp = torch.zeros(len(PROMPTS), R, dtype=torch.float64)
    ent = torch.zeros_like(lp)
    with torch.no_grad():
        for b in range(len(PROMPTS)):
            keep = data["attention_mask"][b].bool()
            ids = data["input_ids"][b][keep][None]
            p, r = int(keep[:P].sum()), int(keep[P:].sum())
            logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].double() / temperature, -1)
            lp[b, :r] = logp[p - 1 : p - 1 + r].gather(-1, ids[0, p : p + r, None])[:, 0]
            ent[b, :r] = -(logp.exp() * logp).sum(-1)[p - 1 : p - 1 + r]
    return lp, ent


@pytest.mark.parametrize("remove_padding", [True, False])
def test_log_probs_and_entropy_match_per_sample_reference(tiny_lm_dir, remove_padding):
    data = make_rl_batch(PROMPTS, RESPONSES, vocab_size=128, seed=5)
    model = load_model(tiny_lm_dir, "actor")
    opts = ForwardOptions(is_critic=False, use_remove_padding=remove_padding, temperature=0.8,
                          calculate_entropy=True, chunk_tokens=4)
    with torch.no_grad():
        out = forward_micro_batch(model, data, opts)
    ref_lp, ref_ent = _reference(tiny_lm_dir, data, 0.8)
    torch.testing.assert_close(out["log_probs"].double(), ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(out["entropy"].double(), ref_ent, atol=2e-5, rtol=0)
    assert torch.all(out["log_probs"][~data["response_mask"].bool()] == 0)


def test_packed_and_padded_agree_in_values_and_gradients(tiny_lm_dir):
    data = make_rl_batch(PROMPTS, RESPONSES, vocab_size=128, seed=6)
    grads, outs = {}, {}
    for rmpad in (True, False):
        model = load_model(tiny_lm_dir, "actor")
        out = forward_micro_batch(model, data, ForwardOptions(is_critic=False, use_remove_padding=rmpad))
        (out["log_probs"] * data["advantages"]).sum().backward()
        outs[rmpad] = out["log_probs"].detach()
        grads[rmpad] = {n: p.grad for n, p in model.named_parameters()}
    torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=0)
    for name in grads[True]:
        torch.testing.assert_close(grads[True][name], grads[False][name], atol=1e-5, rtol=1e-4, msg=name)


def test_critic_values_packed_equal_padded(tiny_lm_dir):
    data = make_rl_batch(PROMPTS, RESPONSES, vocab_size=128, seed=7)
    critic = load_model(tiny_lm_dir, "critic")
    with torch.no_grad():
        packed = forward_micro_batch(critic, data, ForwardOptions(is_critic=True, use_remove_padding=True))
        padded = forward_micro_batch(critic, data, ForwardOptions(is_critic=True, use_remove_padding=False))
    assert set(packed) == {"values"} and packed["values"].shape == data["responses"].shape
    torch.testing.assert_close(packed["values"], padded["values"], atol=1e-5, rtol=0)
    assert packed["values"][data["response_mask"].bool()].abs().sum() > 0
    # the freshly initialised value head is identical for the same seed (ranks must agree)
    again = load_model(tiny_lm_dir, "critic")
    assert torch.equal(again.score.weight, critic.score.weight)


def test_model_is_routed_through_the_ballast_attention(tiny_lm_dir):
    model = load_model(tiny_lm_dir, "ref")
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert not any(p.requires_grad for p in model.parameters())
    # packed position ids without a context: segments derived from positions restarting at 0
    ids = torch.randint(1, 128, (1, 9))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        for s, e in [(0, 4), (4, 6), (6, 9)]:
            alone = model(input_ids=ids[:, s:e], use_cache=False).logits
            torch.testing.assert_close(packed[:, s:e], alone, atol=1e-5, rtol=0)


def test_varlen_attention_equals_dense_block_diagonal_mask():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 10, 8, generator=gen)
    k = torch.randn(1, 2, 10, 8, generator=gen)
    v = torch.randn(1, 2, 10, 8, generator=gen)
    cu = torch.tensor([0, 3, 7, 8], dtype=torch.int32)  # positions 8, 9 are divisibility padding
    out = varlen_causal_attention(q, k, v, cu, max_seqlen=4, scaling=None)
    seg = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 3, 4])
    mask = (seg[:, None] == seg[None, :]) & torch.ones(10, 10, dtype=torch.bool).tril()
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    ).transpose(1, 2)
    torch.testing.assert_close(out[:, :8], dense[:, :8], atol=1e-6, rtol=0)
    assert torch.all(out[:, 8:] == 0)


@pytest.mark.parametrize("shared_layout", [False, True])
def test_bf16_attention_on_cpu_is_the_fp32_attention_rounded(shared_layout):
    """bf16 q/k/v on CPU: output = fp32 attention cast to bf16 (bitwise), gradients in bf16 near fp32's."""
    from ballast.engine.shared_prefix import SharedGroup

    gen = torch.Generator().manual_seed(1)
    q32, k32, v32 = (torch.randn(1, h, 12, 8, generator=gen) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    shared = (SharedGroup(0, 3, (2,)), SharedGroup(5, 4, (1, 2))) \
        if shared_layout else None
    ctx = PackedAttentionContext(cu_seqlens=cu, max_seqlen=7, shared=shared)
    outs, grads = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q32, k32, v32))
        out, _ = ballast_attention_forward(None, q, k, v, None, scaling=0.3, ballast_packed=ctx)
        assert out.dtype == dtype
        out.float().pow(2).sum().backward()
        outs[dtype], grads[dtype] = out.detach(), [t.grad for t in (q, k, v)]
    q, k, v = (t.to(torch.bfloat16).float() for t in (q32, k32, v32))
    exact, _ = ballast_attention_forward(None, q, k, v, None, scaling=0.3, ballast_packed=ctx)
    assert torch.equal(outs[torch.bfloat16], exact.to(torch.bfloat16))
    for g16, g32 in zip(grads[torch.bfloat16], grads[torch.float32]):
        assert g16.dtype == torch.bfloat16
        torch.testing.assert_close(g16.float(), g32, atol=0.05, rtol=0.05)


def test_bf16_model_packed_and_padded_agree(tiny_lm_dir):
    """The padded (mask) path upcasts too: a bf16 model's log-probs agree across both layouts."""
    data = make_rl_batch(PROMPTS, RESPONSES, vocab_size=128, seed=7)
    model = load_model(tiny_lm_dir, "actor").to(torch.bfloat16)
    with torch.no_grad():
        lp = {rmpad: forward_micro_batch(model, data, ForwardOptions(is_critic=False, use_remove_padding=rmpad))
              ["log_probs"] for rmpad in (True, False)}
    mask = data["response_mask"].bool()
    assert lp[True][mask].abs().min() > 0
    torch.testing.assert_close(lp[True], lp[False], atol=0.03, rtol=0)


def test_cpu_offload_is_rejected_on_a_cpu_engine(tiny_lm_dir):
    from types import SimpleNamespace

    from ballast.engine.config import EngineConfig
    from ballast.engine.parallelize import parallelize

    model = load_model(tiny_lm_dir, "actor")
    cfg = EngineConfig(model_path=tiny_lm_dir, cpu_offload=True, device="cpu")
    with pytest.raises(ValueError, match="cpu_offload=True .* CPU-only engine"):
        parallelize(model, SimpleNamespace(sp_size=1, device_type="cpu"), cfg)


def test_ulysses_needs_heads_divisible_by_sp(tiny_lm_dir):
    from types import SimpleNamespace

    from ballast.engine.config import EngineConfig
    from ballast.engine.parallelize import parallelize

    model = load_model(tiny_lm_dir, "actor")  # 4 heads
    cfg = EngineConfig(model_path=tiny_lm_dir, ulysses_sequence_parallel_size=3)
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=3 must divide num_attention_heads=4"):
        parallelize(model, SimpleNamespace(sp_size=3, device_type="cpu"), cfg)


def test_sparse_lookup_only_for_a_trainable_tied_embedding(tmp_path, tiny_lm_dir):
    """A sparse lookup gradient stays dense only when the head's dense gradient is added to it: an
    untied, frozen or critic embedding would hand the optimizer a sparse gradient."""
    from ballast.engine.parallelize import _has_trainable_tied_embedding
    from testkit.models import build_tiny_causal_lm

    tied_dir = build_tiny_causal_lm(str(tmp_path / "tied"), seed=1, tie_word_embeddings=True)
    tied = load_model(tied_dir, "actor")
    assert _has_trainable_tied_embedding(tied)
    assert not _has_trainable_tied_embedding(load_model(tiny_lm_dir, "actor"))  # untied
    assert not _has_trainable_tied_embedding(load_model(tied_dir, "critic"))  # value head, no LM head
    tied.requires_grad_(False)  # a reference model, or a LoRA base
    assert not _has_trainable_tied_embedding(tied)
