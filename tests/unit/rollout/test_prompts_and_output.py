"""The rollout's prompts and output contract: padding, masks, positions, EOS/stop truncation (the output
built by the agent loops' assembler from single-turn conversations, as every rollout call builds it)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ballast.protocol.fields import check_fields
from ballast.workers.rollout.prompts import prompt_token_lists, read_prompts, truncate_at_stop
from testkit.prompts import left_padded_prompts
from testkit.rollout import rollout_output

PAD = 0


def left_pad(token_lists, width=None, pad=PAD):
    prompts = left_padded_prompts(token_lists, width, pad)
    return prompts["input_ids"], prompts["attention_mask"]


def test_prompt_token_lists_unpads_and_rejects_bad_rows():
    ids, mask = left_pad([[5, 6, 7], [8], [9, 10]])
    assert prompt_token_lists(ids, mask) == [[5, 6, 7], [8], [9, 10]]
    right = torch.tensor([[1, 1, 0]])
    with pytest.raises(ValueError, match="row 0 is not left-padded"):
        prompt_token_lists(torch.tensor([[4, 5, 0]]), right)
    with pytest.raises(ValueError, match="row 1 has no tokens"):
        prompt_token_lists(torch.tensor([[4, 5], [0, 0]]), torch.tensor([[1, 1], [0, 0]]))
    with pytest.raises(ValueError, match=r"attention_mask\[0, 1\] = 2"):
        prompt_token_lists(torch.tensor([[4, 5]]), torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="must both be"):
        prompt_token_lists(torch.tensor([4, 5]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="missing 'attention_mask'"):
        read_prompts({"input_ids": ids})


def test_truncate_at_first_stop_token_inclusive():
    assert truncate_at_stop([4, 5, 1, 6, 1], {1}) == [4, 5, 1]
    assert truncate_at_stop([4, 5, 6], {1}) == [4, 5, 6]
    assert truncate_at_stop([4, 9, 5, 1], {1, 9}) == [4, 9]
    assert truncate_at_stop([1, 2], ()) == [1, 2]


def test_output_contract_example():
    ids, mask = left_pad([[5, 6, 7], [8]])
    # Row 0 stops at eos 1 (tokens after it are dropped); row 1 hits the length limit; row 1 has
    # the pad id 0 as a real token, which must stay in the mask.
    out = rollout_output(
        ids, mask, [[11, 1, 12, 13], [0, 14, 15]], [[-0.1, -0.2, -0.3, -0.4], [-1.0, -2.0, -3.0]],
        pad_token_id=PAD, stop_token_ids={1},
    )
    assert out.batch_size == torch.Size([2])
    assert out["prompts"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert out["responses"].tolist() == [[11, 1, 0], [0, 14, 15]]
    assert out["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert out["input_ids"].tolist() == [[5, 6, 7, 11, 1, 0], [0, 0, 8, 0, 14, 15]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]]
    expected_lps = torch.tensor([[-0.1, -0.2, 0.0], [-1.0, -2.0, -3.0]])
    assert torch.allclose(out["rollout_log_probs"], expected_lps)
    sizes = check_fields(
        out, ["prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
              "rollout_log_probs"],
    )
    assert sizes == {"B": 2, "P": 3, "R": 3, "P+R": 6}


def test_fixed_response_length_pads_and_rejects_overflow():
    ids, mask = left_pad([[5]])
    out = rollout_output(ids, mask, [[3, 4]], pad_token_id=9, response_length=5)
    assert out["responses"].tolist() == [[3, 4, 9, 9, 9]]
    assert out["response_mask"].tolist() == [[1, 1, 0, 0, 0]]
    assert "rollout_log_probs" not in out.keys()
    with pytest.raises(ValueError, match="2 response tokens > response_length=1"):
        rollout_output(ids, mask, [[3, 4]], pad_token_id=9, response_length=1)


def test_empty_batch_keeps_shapes():
    ids = torch.zeros((0, 4), dtype=torch.int64)
    out = rollout_output(ids, ids.clone(), [], [], pad_token_id=0, response_length=3)
    assert out["input_ids"].shape == (0, 7) and out["rollout_log_probs"].shape == (0, 3)


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(2, 50), min_size=1, max_size=6), min_size=1, max_size=5),
    responses=st.lists(st.lists(st.integers(0, 50), min_size=0, max_size=8), min_size=5, max_size=5),
    stop=st.sets(st.integers(0, 50), max_size=3),
    fixed=st.booleans(),
)
def test_contract_properties(prompts, responses, stop, fixed):
    responses = responses[: len(prompts)]
    ids, mask = left_pad(prompts)
    out = rollout_output(
        ids, mask, responses, [[-float(j + 1) for j in range(len(r))] for r in responses],
        pad_token_id=PAD, stop_token_ids=stop, response_length=8 if fixed else None,
    )
    width = out["responses"].shape[1]
    assert width == 8 if fixed else width == max(len(truncate_at_stop(r, stop)) for r in responses)
    for i, (prompt, resp) in enumerate(zip(prompts, responses)):
        kept = truncate_at_stop(resp, stop)
        n = len(kept)
        # Exactly the tokens through the first stop id are real; the mask is 1...1 0...0.
        assert out["responses"][i, :n].tolist() == kept
        assert out["response_mask"][i].tolist() == [1] * n + [0] * (width - n)
        assert (out["responses"][i, n:] == PAD).all()
        assert (out["rollout_log_probs"][i, n:] == 0).all()
        assert out["rollout_log_probs"][i, :n].tolist() == [-float(j + 1) for j in range(n)]
        if n and n < len(resp):
            assert kept[-1] in stop and not set(kept[:-1]) & stop
        # The real tokens of the full sequence are the prompt then the kept response, and their
        # positions count 0, 1, 2, ... without gaps.
        full_mask = out["attention_mask"][i].bool()
        assert out["input_ids"][i][full_mask].tolist() == prompt + kept
        assert out["position_ids"][i][full_mask].tolist() == list(range(len(prompt) + n))
