"""The canonical field table and `check_fields`: missing keys, wrong kinds/dtypes, inconsistent shapes."""

import re

import numpy as np
import pytest
import torch

from ballast.protocol import FIELDS, Batch, check_fields
from ballast.protocol import fields as fields_module

NUM_SAMPLES, PROMPT_LEN, RESPONSE_LEN = 4, 5, 3


def full_batch() -> Batch:
    """Every canonical field with its canonical dtype and mutually consistent shapes."""
    tensors, non_tensors = {}, {}
    sizes = {"B": NUM_SAMPLES, "P": PROMPT_LEN, "R": RESPONSE_LEN, "P+R": PROMPT_LEN + RESPONSE_LEN}
    for name, spec in FIELDS.items():
        shape = tuple(sizes[dim] for dim in spec.shape)
        if spec.is_tensor:
            tensors[name] = torch.zeros(shape, dtype=spec.dtype)
        elif spec.dtype == np.dtype(object):
            non_tensors[name] = np.array([{"ground_truth": "1"}] * NUM_SAMPLES, dtype=object)
        else:
            non_tensors[name] = np.zeros(shape, dtype=spec.dtype)
    return Batch(tensors, non_tensors)


def test_required_issue_keys_are_in_the_table_with_their_shapes():
    expected = {
        "prompts": (("B", "P"), torch.int64),
        "responses": (("B", "R"), torch.int64),
        "input_ids": (("B", "P+R"), torch.int64),
        "attention_mask": (("B", "P+R"), torch.int64),
        "position_ids": (("B", "P+R"), torch.int64),
        "response_mask": (("B", "R"), torch.int64),
        "uid": (("B",), np.dtype(object)),
    }
    for name in ["old_log_probs", "ref_log_prob", "values", "advantages", "returns",
                 "token_level_scores", "token_level_rewards", "rollout_log_probs"]:
        expected[name] = (("B", "R"), torch.float32)
    for name, (shape, dtype) in expected.items():
        assert (FIELDS[name].shape, FIELDS[name].dtype) == (shape, dtype), name
    assert {"data_source", "reward_model"} <= set(FIELDS)
    assert not FIELDS["uid"].is_tensor and FIELDS["responses"].is_tensor


def test_docstring_table_matches_fields():
    rows = re.findall(r"^\| (\w+) \| \(([^)]*)\) \| (\w+) \| ([^|]*) \| ([^|]*) \| ([^|]*) \|$",
                      fields_module.__doc__, flags=re.MULTILINE)
    split = lambda cell: tuple(part.strip() for part in cell.split(",") if part.strip() not in ("", "-"))
    documented = {name: (split(shape), dtype, split(writers), split(readers), meaning)
                  for name, shape, dtype, writers, readers, meaning in rows}
    in_code = {name: (spec.shape, str(spec.dtype).removeprefix("torch."), spec.written_by, spec.read_by, spec.meaning)
               for name, spec in FIELDS.items()}
    assert documented == in_code


def test_a_field_names_known_writers_and_readers():
    with pytest.raises(ValueError, match="field 'x': .*unknown: \\['the loss'\\]"):
        fields_module.FieldSpec("x", ("B",), torch.int64, "a field", ("data",), ("the loss",))
    with pytest.raises(ValueError, match="field 'x': .*at least one writer"):
        fields_module.FieldSpec("x", ("B",), torch.int64, "a field")
    with pytest.raises(ValueError, match="unknown reader 'loss'"):
        fields_module.columns_read_by("loss")


def test_full_batch_passes_and_reports_sizes():
    sizes = check_fields(full_batch(), list(FIELDS))
    assert sizes == {"B": 4, "P": 5, "R": 3, "P+R": 8}


def test_compound_dim_derives_missing_part():
    batch = Batch({"input_ids": torch.zeros(2, 9, dtype=torch.int64), "responses": torch.zeros(2, 4, dtype=torch.int64)})
    assert check_fields(batch, ["input_ids", "responses"]) == {"B": 2, "R": 4, "P": 5, "P+R": 9}


def test_missing_field_is_named_with_its_spec():
    batch = full_batch().select(["prompts", "uid"])
    with pytest.raises(ValueError, match=r"batch is missing field 'responses': expected \(B, R\) int64 tensor"):
        check_fields(batch, ["prompts", "responses"])


def test_unknown_field_is_rejected():
    with pytest.raises(ValueError, match="'log_probs' is not a canonical field"):
        check_fields(full_batch(), "log_probs")


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("old_log_probs", torch.zeros(4, 3, dtype=torch.bfloat16), "field 'old_log_probs' has dtype bfloat16, expected float32"),
        ("response_mask", torch.ones(4, 3, dtype=torch.bool), "field 'response_mask' has dtype bool, expected int64"),
        ("uid", torch.zeros(4), "field 'uid' must be a non-tensor numpy array, got Tensor"),
        ("responses", np.zeros((4, 3), dtype=np.int64), "field 'responses' must be a tensor, got ndarray"),
        ("uid", np.array(["a", "b", "c", "d"]), "field 'uid' has dtype <U1, expected object"),
        ("advantages", torch.zeros(4, 3, 1), r"field 'advantages' has shape \(4, 3, 1\), expected 2 dims \(B, R\)"),
        ("advantages", torch.zeros(4, 7), r"field 'advantages' has shape \(4, 7\): dim R = 7, expected 3 \(from 'responses'\)"),
        ("input_ids", torch.zeros(4, 9, dtype=torch.int64), r"field 'input_ids' has shape \(4, 9\): dim P\+R = 9, expected 8 \(P from 'prompts' \+ R from 'responses'\)"),
    ],
)
def test_wrong_field_is_named_with_numbers(key, value, message):
    batch = full_batch()
    batch[key] = value
    with pytest.raises(ValueError, match=message):
        check_fields(batch, ["prompts", "responses", "input_ids", "advantages", "response_mask", "uid", "old_log_probs"])


def test_prompt_longer_than_sequence_is_caught():
    batch = Batch({"prompts": torch.zeros(2, 6, dtype=torch.int64), "attention_mask": torch.zeros(2, 4, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"dim P\+R = 4, expected at least 6 \(P from 'prompts'\)"):
        check_fields(batch, ["attention_mask", "prompts"])
