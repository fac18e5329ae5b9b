"""A custom reward function that raises or returns the wrong thing stops the run with an error naming
the step, the dataset row, the data source and the value (never a skipped sample), and the command
line maps it to exit code 2 and prints the function's own traceback; one that never returns stops
the run after `reward.timeout_s`."""

import math
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ballast.protocol import Batch
from ballast.trainer.main import EXIT_BAD_INPUT, failure
from ballast.trainer.step.reward import RewardFunctionError, RewardManager


@pytest.fixture(scope="module")
def tokenizer():
    from ballast.models import load_tokenizer, tiny_model_dir

    return load_tokenizer(tiny_model_dir())


def _batch(num_rows=3):
    responses = torch.tensor([[5, 6, 7, 0]] * num_rows)
    mask = torch.tensor([[1, 1, 1, 0]] * num_rows)
    sources = np.array(["src/a", "src/b", "src/c"][:num_rows], dtype=object)
    reward_model = np.empty(num_rows, dtype=object)
    for i in range(num_rows):
        reward_model[i] = {"ground_truth": "x"}
    return Batch({"responses": responses, "response_mask": mask}, {"data_source": sources, "reward_model": reward_model})


def _score_on_row(bad_row, bad_value):
    def score(data_source, solution_str, ground_truth, extra_info=None):
        if data_source == f"src/{'abc'[bad_row]}":
            if isinstance(bad_value, Exception):
                raise bad_value
            return bad_value
        return 0.5
    return score


@pytest.mark.parametrize("bad_value, fragment", [
    (ZeroDivisionError("division by zero"),
     r"reward function failed on validation, batch position 1 \(data_source 'src/b'\): "
     r"ZeroDivisionError: division by zero"),
    ([0.1, 0.2], r"reward for row 1 \(data_source 'src/b'\) must be a finite number, got list \[0\.1, 0\.2\]"),
    (np.array([0.5, 0.5]), r"row 1 \(data_source 'src/b'\) must be a finite number, got ndarray"),
    (math.nan, r"reward for row 1 \(data_source 'src/b'\) must be finite, got nan"),
    ({"acc": 1.0}, r"row 1 \(data_source 'src/b'\) is a dict without a 'score' key: keys \['acc'\]"),
    ("1.0", r"must be a finite number, got str '1\.0'"),
], ids=["raises", "list", "array", "nan", "dict without score", "string"])
def test_bad_reward_function_result_names_row_source_and_value(tokenizer, bad_value, fragment):
    manager = RewardManager(tokenizer, _score_on_row(1, bad_value))
    with pytest.raises(RewardFunctionError, match=fragment) as info:
        manager(_batch())
    code, line = failure(info.value)
    assert code == EXIT_BAD_INPUT and line.startswith("reward function: ") and "\n" not in line


def test_good_reward_function_scores_every_row_on_its_last_token(tokenizer):
    scores, _ = RewardManager(tokenizer, _score_on_row(0, 0.25))(_batch())
    assert scores[:, 2].tolist() == [0.25, 0.5, 0.5]
    assert float(scores.sum()) == pytest.approx(1.25)


def _indexed_batch():
    batch = _batch()
    index = np.empty(3, dtype=object)
    index[:] = [40, 41, 42]
    batch["index"] = index
    return batch


def test_reward_error_names_the_step_and_dataset_row_and_keeps_the_users_traceback(tokenizer, capsys, monkeypatch):
    from omegaconf import OmegaConf

    import ballast.trainer.run.preflight as preflight
    from ballast.trainer import main

    def broken(data_source, solution_str, ground_truth, extra_info=None):
        if data_source == "src/c":
            return {"score": 1.0} / 2  # the user's bug: a TypeError on this very line
        return 0.5

    with pytest.raises(RewardFunctionError, match=r"failed on step 7, dataset row 42 \(data_source 'src/c', "
                                                  r"batch position 2\): TypeError") as info:
        RewardManager(tokenizer, broken)(_indexed_batch(), step=7)
    assert isinstance(info.value.__cause__, TypeError)

    def raising_run(prepared, raw_config=None, resume=None):
        raise info.value

    monkeypatch.setattr(main, "to_typed", lambda raw: SimpleNamespace(trainer=None))
    monkeypatch.setattr(main, "prepare_typed", lambda cfg: main.PreparedRun(cfg=None, plan=None, data=None, reward=None))
    monkeypatch.setattr(main, "run", raising_run)
    monkeypatch.setattr(preflight, "refuse_early", lambda trainer: None)
    monkeypatch.setattr(preflight, "claim_run_dir", lambda cfg: (None, None))
    code = main.cli_run(OmegaConf.create({}))
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT
    assert "Traceback" in err and "in broken" in err and "{\"score\": 1.0} / 2" in err, err
    assert err.strip().splitlines()[-1].startswith("ballast: reward function: reward function failed on step 7, "
                                                   "dataset row 42")


def test_reward_function_that_never_returns_stops_after_the_timeout(tokenizer):
    release = threading.Event()

    def hangs(data_source, solution_str, ground_truth, extra_info=None):
        if data_source == "src/b":
            release.wait(60)
        return 0.5

    manager = RewardManager(tokenizer, hangs, timeout_s=0.5)
    start = time.monotonic()
    try:
        with pytest.raises(RewardFunctionError, match=r"did not return within reward\.timeout_s=0\.5s on step 3, "
                                                      r"dataset row 41 \(data_source 'src/b'"):
            manager(_indexed_batch(), step=3)
    finally:
        release.set()
    assert time.monotonic() - start < 5
    assert failure(RewardFunctionError("x"))[0] == EXIT_BAD_INPUT
    # the manager still works after a timeout (a fresh helper thread), and without a limit runs inline
    scores, _ = manager(_batch())
    assert scores[:, 2].tolist() == [0.5, 0.5, 0.5]
    inline = RewardManager(tokenizer, lambda *a: threading.current_thread() is threading.main_thread() and 1.0)
    assert inline(_batch())[0][:, 2].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("body, fragment", [
    ("return '1.0'", r"returned an unusable result on step 4, batch position 0 \(data_source 'src/a'\): reward for "
                     r"row 0 \(data_source 'src/a'\) must be a finite number, got str '1\.0'"),
    ("return 1 / 0", r"failed on step 4, batch position 0 \(data_source 'src/a'\): ZeroDivisionError"),
], ids=["returns a string", "raises"])
def test_custom_reward_function_errors_name_its_file_and_function(tokenizer, tmp_path, body, fragment):
    path = tmp_path / "my_reward.py"
    path.write_text(f"def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    {body}\n")
    manager = RewardManager.from_config(tokenizer, str(path), "my_score", "data_source")
    with pytest.raises(RewardFunctionError, match=rf"^reward function 'my_score' in '{path}' {fragment}") as info:
        manager(_batch(), step=4)
    code, line = failure(info.value)
    assert code == EXIT_BAD_INPUT and line.startswith(f"reward function: reward function 'my_score' in '{path}' ")
