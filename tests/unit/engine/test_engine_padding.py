"""Packed <-> padded layout helpers: every real token exactly once, positions, slots, bad layouts."""

import pytest
import torch

from ballast.engine import padding
from testkit.engine import make_rl_batch


def _batch():
    return make_rl_batch([3, 1, 5, 2], [4, 0, 2, 6], vocab_size=50, seed=0)


def test_unpad_packs_every_real_token_once_in_row_order():
    data = _batch()
    packed = padding.unpad(data["input_ids"], data["attention_mask"])
    lengths = data["attention_mask"].sum(-1)
    assert packed.num_tokens == int(lengths.sum())
    assert packed.cu_seqlens.tolist() == [0] + torch.cumsum(lengths, 0).tolist()
    assert packed.max_seqlen == int(lengths.max())
    for b in range(4):
        s, e = packed.cu_seqlens[b], packed.cu_seqlens[b + 1]
        expected = data["input_ids"][b][data["attention_mask"][b].bool()]
        assert torch.equal(packed.input_ids[s:e], expected)
        assert packed.position_ids[s:e].tolist() == list(range(int(e - s)))
    # packed position ids equal the padded layout's own position ids at real tokens
    assert torch.equal(packed.position_ids, data["position_ids"].reshape(-1)[packed.flat_indices])


def test_pad_back_inverts_unpad_and_zeros_padding():
    data = _batch()
    packed = padding.unpad(data["input_ids"], data["attention_mask"])
    back = padding.pad_back(packed.input_ids, packed.flat_indices, *data["input_ids"].shape)
    assert torch.equal(back, data["input_ids"] * data["attention_mask"])
    vec = torch.randn(packed.num_tokens, 3, requires_grad=True)
    out = padding.pad_back(vec, packed.flat_indices, *data["input_ids"].shape)
    out.sum().backward()
    assert torch.equal(vec.grad, torch.ones_like(vec))


def test_cu_seqlens_from_position_ids_splits_where_positions_restart():
    pos = torch.tensor([0, 1, 2, 0, 0, 1, 2, 3])
    assert padding.cu_seqlens_from_position_ids(pos).tolist() == [0, 3, 4, 8]
    assert padding.cu_seqlens_from_position_ids(torch.tensor([5, 6, 7])).tolist() == [0, 3]
    cu = torch.tensor([0, 2, 7, 7, 9], dtype=torch.int32)
    assert padding.packed_position_ids(cu).tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1]


def test_response_slots_point_at_the_position_before_each_response_token():
    data = _batch()
    R = data["responses"].shape[1]
    P = data["input_ids"].shape[1] - R
    slots = padding.response_slots(data["attention_mask"], R)
    assert torch.equal(slots.valid, data["response_mask"].bool())
    packed = padding.unpad(data["input_ids"], data["attention_mask"])
    for b, j, pp, kp in zip(slots.rows, slots.cols, slots.padded_pos, slots.packed_pos):
        assert pp == b * (P + R) + P - 1 + j
        # the packed token at packed_pos is the padded token at padded_pos
        assert packed.input_ids[kp] == data["input_ids"].reshape(-1)[pp]
        # and the token after it (same row) is the response token it predicts
        assert packed.input_ids[kp + 1] == data["responses"][b, j]
    vals = torch.arange(len(slots.rows), dtype=torch.float32) + 1
    grid = padding.scatter_response(vals, slots, 4, R)
    assert torch.equal(grid != 0, slots.valid)


@pytest.mark.parametrize(
    "mask, message",
    [
        ([[1, 0, 1, 1, 0]], "row 0 is not one contiguous run"),
        ([[1, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]], "row 2 has padding at the last prompt column P-1=2"),
    ],
)
def test_bad_layouts_are_rejected_with_the_row(mask, message):
    with pytest.raises(ValueError, match=message):
        padding.check_padded_layout(torch.tensor(mask), response_len=2)


def test_layout_needs_prompt_and_response_columns():
    with pytest.raises(ValueError, match="S=3 columns, responses have R=3"):
        padding.check_padded_layout(torch.ones(2, 3, dtype=torch.long), response_len=3)
