"""Shared prompts: each distinct prompt runs once, and the outputs and gradients are those of the
rows run apart (the plain packed layout, itself checked against a per-sample reference)."""

import pytest
import torch
import torch.nn.functional as F

from ballast.engine.forward import ForwardOptions, forward_micro_batch
from ballast.engine.model import load_model
from ballast.engine.padding import response_slots
from ballast.engine.shared_prefix import SharedGroup, pack_shared, prompt_groups, shared_prefix_attention
from testkit.engine import make_rl_batch

# Rows 0, 2, 5 share prompt A (7 tokens); rows 1, 4 share prompt B (4 tokens); row 3 has its own
# prompt C (7 tokens, same length as A, other tokens); row 4's response is empty.
PROMPT_OF = [0, 1, 0, 2, 1, 0]
PROMPT_LENS = [7, 4, 7]
RESPONSES = [5, 3, 9, 6, 0, 2]


def grouped_batch(seed: int):
    data = make_rl_batch([PROMPT_LENS[g] for g in PROMPT_OF], RESPONSES, vocab_size=128, seed=seed)
    width = data["input_ids"].shape[1] - data["responses"].shape[1]
    first = {}
    for row, g in enumerate(PROMPT_OF):
        first.setdefault(g, row)
        data["input_ids"][row, :width] = data["input_ids"][first[g], :width]
    return data


def _run(model_dir, data, share, critic=False, backward=False):
    model = load_model(model_dir, "critic" if critic else "actor")
    opts = ForwardOptions(is_critic=critic, use_remove_padding=True, temperature=0.9, calculate_entropy=not critic,
                          chunk_tokens=8, share_prompts=share)
    with torch.set_grad_enabled(backward):
        out = forward_micro_batch(model, data, opts)
    grads = None
    if backward:
        (out["log_probs"] * data["advantages"]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in out.items()}, grads


def test_groups_are_rows_with_equal_prompts_in_first_seen_order():
    data = grouped_batch(seed=1)
    groups = prompt_groups(data["input_ids"], data["attention_mask"], data["position_ids"], data["responses"].shape[1])
    assert groups == [[0, 2, 5], [1, 4], [3]]


def test_pack_holds_each_prompt_once_and_points_first_tokens_at_the_last_prompt_token():
    data = grouped_batch(seed=2)
    slots = response_slots(data["attention_mask"], data["responses"].shape[1])
    pack = pack_shared(data["input_ids"], data["attention_mask"], data["position_ids"], slots)
    assert pack.num_tokens == sum(PROMPT_LENS) + sum(RESPONSES)
    assert [(g.prompt_len, g.response_lens) for g in pack.groups] == [(7, (5, 9, 2)), (4, (3, 0)), (7, (6,))]
    width = data["input_ids"].shape[1] - data["responses"].shape[1]
    for n, (row, col) in enumerate(zip(slots.rows.tolist(), slots.cols.tolist())):
        # the packed token at the predicting position is the one before the response token in its own row
        assert pack.input_ids[pack.packed_pos[n]] == data["input_ids"][row, width + col - 1]
        assert pack.position_ids[pack.packed_pos[n]] == data["position_ids"][row, width + col - 1]
    first_tokens = pack.packed_pos[slots.cols == 0]
    assert len(set(first_tokens[slots.rows[slots.cols == 0] != 3].tolist())) == 2  # one per shared group


@pytest.mark.parametrize("groups", [
    (SharedGroup(0, 3, (2, 4)), SharedGroup(9, 2, (3,))),
    # empty responses, a group whose only response is empty, groups of different widths
    (SharedGroup(0, 3, (2, 0, 4)), SharedGroup(9, 2, (0,)), SharedGroup(11, 5, (3, 1))),
])
def test_shared_attention_and_its_gradients_equal_a_dense_masked_reference(groups):
    torch.manual_seed(0)
    end = sum(g.length for g in groups)
    length = end + 2  # two positions of divisibility padding
    q = torch.randn(1, 4, length, 8, requires_grad=True)
    k = torch.randn(1, 2, length, 8, requires_grad=True)
    v = torch.randn(1, 2, length, 8, requires_grad=True)
    out = shared_prefix_attention(q, k, v, groups, scaling=None)
    segment = torch.full((length,), -1)  # -1: prompt, i: response i, -2: padding
    owner = torch.full((length,), -1)  # group of each token
    for g, group in enumerate(groups):
        owner[group.start:group.start + group.length] = g
        a = group.start + group.prompt_len
        for i, r in enumerate(group.response_lens):
            segment[a:a + r] = i
            a += r
    idx = torch.arange(length)
    allowed = (owner[:, None] == owner[None, :]) & (owner[:, None] >= 0) & (idx[None, :] <= idx[:, None])
    allowed &= (segment[None, :] == -1) | (segment[None, :] == segment[:, None])
    allowed |= torch.eye(length, dtype=torch.bool)  # padding rows attend to themselves; zeroed below
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=allowed)
    ref = ref.transpose(1, 2) * (owner >= 0)[None, :, None, None]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.all(out[:, end:] == 0)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)


def test_shared_outputs_and_gradients_equal_the_rows_run_apart(tiny_lm_dir):
    data = grouped_batch(seed=3)
    plain, plain_grads = _run(tiny_lm_dir, data, share=False, backward=True)
    shared, shared_grads = _run(tiny_lm_dir, data, share=True, backward=True)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(shared[key], plain[key], atol=2e-5, rtol=0)
    assert torch.all(shared["log_probs"][~data["response_mask"].bool()] == 0)
    assert plain_grads.keys() == shared_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(shared_grads[name], plain_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    # the shared run is not the plain one in disguise: it feeds fewer tokens
    assert sum(PROMPT_LENS) + sum(RESPONSES) < int(data["attention_mask"].sum())


def test_shared_critic_values_equal_the_rows_run_apart(tiny_lm_dir):
    data = grouped_batch(seed=4)
    plain, _ = _run(tiny_lm_dir, data, share=False, critic=True)
    shared, _ = _run(tiny_lm_dir, data, share=True, critic=True)
    torch.testing.assert_close(shared["values"], plain["values"], atol=1e-5, rtol=0)


def test_shared_prompts_need_the_packed_layout(tiny_lm_dir):
    model = load_model(tiny_lm_dir, "actor")
    opts = ForwardOptions(is_critic=False, use_remove_padding=False, share_prompts=True)
    with pytest.raises(ValueError, match="use_remove_padding=True"):
        forward_micro_batch(model, grouped_batch(seed=5), opts)
