"""concat_padded: batches of different rollout calls (different prompt and response widths) combine into
exactly the layout one rollout call over all their rows would have produced."""

import numpy as np
import pytest
import torch

from ballast.protocol import Batch, concat_padded, pad_to_widths
from testkit.prompts import left_padded_prompts
from testkit.rollout import rollout_output

PAD = 7


def _rollout(prompts, responses, prompt_width=None, response_length=None, uid="g"):
    """A rollout call's output for `prompts` / `responses` (token lists), plus a float response field
    and a uid per row, as the driver holds it after scoring."""
    layout = left_padded_prompts(prompts, width=prompt_width, pad=PAD, position_ids=True)
    out = rollout_output(layout["input_ids"], layout["attention_mask"], responses,
                         log_probs=[[-0.5] * len(r) for r in responses], pad_token_id=PAD,
                         response_length=response_length)
    scores = torch.zeros(out["responses"].shape, dtype=torch.float32)
    for row, tokens in enumerate(responses):
        scores[row, len(tokens) - 1] = float(tokens[0])  # a value of the row, not of its position
    batch = Batch(dict(out.items()), {"uid": np.array([f"{uid}-{i}" for i in range(len(prompts))], dtype=object)})
    batch["token_level_scores"] = scores
    return batch


PROMPTS_A, RESPONSES_A = [[1, 2], [3, 4, 5]], [[10, 11, 12], [13]]
PROMPTS_B, RESPONSES_B = [[20, 21, 22, 23, 24], [25]], [[30, 31], [32, 33, 34, 35, 36]]


def test_batches_of_different_prompt_widths_do_not_concatenate_as_they_are():
    a, b = _rollout(PROMPTS_A, RESPONSES_A, response_length=5), _rollout(PROMPTS_B, RESPONSES_B, response_length=5)
    with pytest.raises(ValueError, match="key 'prompts' is int64\\[3\\] per sample in batch 0 but int64\\[5\\]"):
        Batch.concat([a, b])


@pytest.mark.parametrize("response_length", [None, 6])  # responses as wide as each call's longest, or fixed
def test_concat_padded_equals_one_rollout_over_all_rows(response_length):
    a = _rollout(PROMPTS_A, RESPONSES_A, response_length=response_length, uid="a")
    b = _rollout(PROMPTS_B, RESPONSES_B, response_length=response_length, uid="b")
    merged = concat_padded([a, b], PAD)
    whole = _rollout(PROMPTS_A + PROMPTS_B, RESPONSES_A + RESPONSES_B,
                     response_length=response_length or max(map(len, RESPONSES_A + RESPONSES_B)))
    assert merged["prompts"].shape == (4, 5) and merged["responses"].shape == (4, response_length or 5)
    for key in whole.tensor_keys:
        assert torch.equal(merged[key], whole[key]), key
    assert list(merged["uid"]) == ["a-0", "a-1", "b-0", "b-1"]


def test_widening_keeps_prompts_left_padded_and_responses_right_padded():
    a = _rollout(PROMPTS_A, RESPONSES_A)
    a["rollout_versions"] = torch.tensor([[3, 3, 4], [4, -1, -1]])  # partial rollouts' per-token versions
    wide = pad_to_widths(a, prompt_width=6, response_width=5, pad_token_id=PAD)
    assert wide["prompts"][1].tolist() == [PAD, PAD, PAD, 3, 4, 5]
    assert wide["responses"][1].tolist() == [13, PAD, PAD, PAD, PAD]
    assert wide["input_ids"][1].tolist() == [PAD, PAD, PAD, 3, 4, 5, 13, PAD, PAD, PAD, PAD]
    assert wide["attention_mask"][1].tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    assert wide["position_ids"][1].tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert wide["rollout_log_probs"][0].tolist() == [-0.5, -0.5, -0.5, 0.0, 0.0]
    assert wide["token_level_scores"][0].tolist() == [0.0, 0.0, 10.0, 0.0, 0.0]
    assert wide["rollout_versions"].tolist() == [[3, 3, 4, -1, -1], [4, -1, -1, -1, -1]]  # no weights sampled them
    assert torch.equal(wide["input_ids"], torch.cat([wide["prompts"], wide["responses"]], dim=1))
    assert list(wide["uid"]) == list(a["uid"])
    with pytest.raises(ValueError, match="cannot narrow a batch of prompt width 3"):
        pad_to_widths(a, prompt_width=2, response_width=5, pad_token_id=PAD)


def test_batches_without_prompt_layout_concatenate_unchanged_or_are_refused():
    plain = [Batch({"x": torch.ones(2, 3)}), Batch({"x": torch.zeros(1, 3)})]
    assert concat_padded(plain, PAD)["x"].shape == (3, 3)
    # full sequences whose prompt part cannot be told from the response part
    seqs = [Batch({"input_ids": torch.ones(1, 4, dtype=torch.int64)}),
            Batch({"input_ids": torch.ones(1, 6, dtype=torch.int64)})]
    with pytest.raises(ValueError, match="key 'input_ids' is int64\\[4\\] per sample in batch 0 but int64\\[6\\]"):
        concat_padded(seqs, PAD)
    with_responses = [_rollout(PROMPTS_A, RESPONSES_A).select(["input_ids", "responses"]),
                      _rollout(PROMPTS_B, RESPONSES_B).select(["input_ids", "responses"])]
    merged = concat_padded(with_responses, PAD)  # prompt width = full width - response width
    assert merged["input_ids"].shape == (4, 10)
    assert merged["input_ids"][0].tolist() == [PAD, PAD, PAD, 1, 2, 10, 11, 12, PAD, PAD]
