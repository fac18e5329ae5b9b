"""TP gather/split without processes: simulate the all-gather and check every rank gets its own rows back."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from ballast.workers.rollout.postprocess import build_rollout_output, read_prompts
from ballast.workers.rollout.tp import TPGatherInfo, merge_gathered, pad_prompts, split_rank_output, tp_group_ranks
from testkit.prompts import left_padded_prompts

PAD = 0


def left_padded(token_lists, width):
    return left_padded_prompts(token_lists, width, PAD, position_ids=True)


def fake_generate(prompts: TensorDict) -> TensorDict:
    """A row-wise deterministic 'engine': the response depends only on the row's own prompt."""
    ids, mask, pos, lists = read_prompts(prompts)
    responses = [[(sum(t) + k) % 97 + 2 for k in range(len(t) % 4 + 1)] for t in lists]
    log_probs = [[-0.5 * (k + 1) for k in range(len(r))] for r in responses]
    return build_rollout_output(ids, mask, pos, responses, log_probs, pad_token_id=PAD, response_length=4)


def test_tp_group_ranks_are_consecutive():
    assert tp_group_ranks(4, 2) == [[0, 1], [2, 3]]
    assert tp_group_ranks(3, 1) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 must divide world_size=3"):
        tp_group_ranks(3, 2)


def test_pad_prompts_left_pads_columns_and_appends_masked_rows():
    p = left_padded([[5, 6], [7]], 2)
    out = pad_prompts(p["input_ids"], p["attention_mask"], p["position_ids"], 3, 4, PAD)
    assert out.shape == (3, 3, 4)
    assert out[0].tolist() == [[0, 0, 5, 6], [0, 0, 0, 7], [0, 0, 0, 0]]
    assert out[1].tolist() == [[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert out[2].tolist() == [[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="cannot pad"):
        pad_prompts(p["input_ids"], p["attention_mask"], p["position_ids"], 1, 4, PAD)


@settings(max_examples=40, deadline=None)
@given(
    per_rank=st.lists(
        st.lists(st.lists(st.integers(2, 90), min_size=1, max_size=7), min_size=0, max_size=4),
        min_size=2, max_size=4,
    ),
    extra_width=st.lists(st.integers(0, 3), min_size=4, max_size=4),
)
def test_gather_generate_split_equals_generating_each_rank_alone(per_rank, extra_width):
    # Each rank's local batch: its own row count and its own (left-padded) prompt width.
    local = []
    for r, lists in enumerate(per_rank):
        width = max((len(t) for t in lists), default=1) + extra_width[r]
        local.append(left_padded(lists, width))
    info_rows = tuple(len(t) for t in per_rank)
    info_widths = tuple(p["input_ids"].shape[1] for p in local)
    max_rows, max_width = max(info_rows), max(info_widths)
    # The all-gather, simulated: every rank contributes its padded stack.
    stacked = torch.stack([
        pad_prompts(p["input_ids"], p["attention_mask"], p["position_ids"], max_rows, max_width, PAD)
        for p in local
    ])
    gathered = merge_gathered(stacked, info_rows)
    assert gathered.batch_size == torch.Size([sum(info_rows)])
    output = fake_generate(gathered) if sum(info_rows) else None
    for rank, prompts in enumerate(local):
        info = TPGatherInfo(rank=rank, rows_per_rank=info_rows, prompt_len_per_rank=info_widths)
        if output is None:
            continue
        mine = split_rank_output(output, info)
        alone = fake_generate(prompts) if len(prompts) else None
        assert mine.batch_size == torch.Size([len(prompts)])
        assert torch.equal(mine["prompts"], prompts["input_ids"])
        if alone is None:
            continue
        assert set(mine.keys()) == set(alone.keys())
        for key in alone.keys():
            assert torch.equal(mine[key], alone[key]), key
