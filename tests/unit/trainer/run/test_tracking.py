"""Tracking backends write what they promise, and secrets never reach the config dump."""

import json
import os

from ballast.trainer.run.tracking import (
    Tracker, format_console, format_validation, progress_postfix, redact, verbose_output, worker_log_dir,
)


def test_jsonl_tensorboard_console_and_redaction(tmp_path):
    lines = []
    config = {"trainer": {"project_name": "p"}, "wandb_api_key": "sk-123", "nested": {"hf_token": "t", "ok": 1}}
    tracker = Tracker(["console", "jsonl", "tensorboard"], "p", "e", str(tmp_path), config=config,
                      console=lines.append)
    tracker.log({"critic/score/mean": 0.25, "actor/pg_loss": float("nan")}, step=3)
    tracker.finish()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows == [{"step": 3, "critic/score/mean": 0.25, "actor/pg_loss": "nan"}]
    assert lines == ["step 3 | critic/score/mean=0.25 | actor/pg_loss=nan"]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tensorboard"))
    dumped = json.load(open(tmp_path / "config.json"))
    assert dumped["wandb_api_key"] == "***" and dumped["nested"]["hf_token"] == "***"
    assert dumped["nested"]["ok"] == 1 and "sk-123" not in (tmp_path / "config.json").read_text()


def test_wandb_runs_offline_without_an_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a wandb entry
    import wandb

    tracker = Tracker(["wandb"], "ballast-test", "offline-run", str(tmp_path / "run"), config={"a": 1})
    try:
        assert tracker._wandb.settings.mode == "offline"
        tracker.log({"x": 1.0}, step=1)
        tracker.finish()
        assert os.path.isdir(tmp_path / "run" / "wandb")
    finally:
        wandb.teardown()  # wandb's service process would otherwise live as long as this process


def test_redact_and_console_format():
    assert redact({"password": None, "list": [{"secret": 1}]}) == {"password": None, "list": [{"secret": "***"}]}
    ordinary = {"prompt_key": "prompt", "reward_fn_key": "data_source", "ppo_max_token_len_per_gpu": 4096,
                "max_num_batched_tokens": 8192, "log_prob_max_token_len_per_gpu": 1024}
    assert redact(ordinary) == ordinary
    secrets = {"WANDB_API_KEY": "a", "hf_token": "b", "aws_access_key": "c", "db_password": "d", "auth": "e"}
    assert set(redact(secrets).values()) == {"***"}
    assert format_console({"timing_s/step": 1.23456}, 7) == "step 7 | timing_s/step=1.235"


def test_rewind_keeps_the_rows_a_resumed_run_continues_from(tmp_path):
    tracker = Tracker(["jsonl"], "p", "e", str(tmp_path))
    for step in (0, 1, 2, 3):
        tracker.log({"x": float(step)}, step=step)
    tracker.rewind(2)  # resumed from the step-2 checkpoint: step 3 will be produced again
    tracker.log({"x": 30.0}, step=3)
    tracker.finish()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["x"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
    fresh = Tracker(["jsonl"], "p", "e", str(tmp_path))
    fresh.rewind(0)  # a fresh run in the same directory starts a new file
    fresh.finish()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_rewind_drops_a_last_row_cut_short_by_a_kill(tmp_path):
    tracker = Tracker(["jsonl"], "p", "e", str(tmp_path))
    for step in (1, 2):
        tracker.log({"x": float(step)}, step=step)
    tracker.finish()
    with open(tmp_path / "metrics.jsonl", "a") as f:  # step 3's row, cut short by a kill -9
        f.write('{"step": 3, "x": 3.0, "actor/pg_lo')
    resumed = Tracker(["jsonl"], "p", "e", str(tmp_path))
    resumed.rewind(2)  # used to raise JSONDecodeError: the resumed run could not start
    resumed.log({"x": 30.0}, step=3)
    resumed.finish()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["x"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_progress_bar_numbers_and_validation_line():
    metrics = {"critic/score/mean": 0.4567, "actor/pg_loss": -0.01234, "response_length/mean": 61.61, "actor/lr": 1.0}
    assert progress_postfix(metrics) == {"score": "0.457", "pg_loss": "-0.0123", "resp_len": "61.6"}
    corrected = dict(metrics, **{"rollout_corr/k3_kl": 0.001234, "rollout_corr/rollout_rs_masked_fraction": 0.05})
    assert progress_postfix(corrected) == {"score": "0.457", "pg_loss": "-0.0123", "resp_len": "61.6",
                                           "mismatch_kl": "0.00123", "rejected": "0.05"}
    one = {"val/score/mean": 0.25, "val/score/synthetic": 0.25, "val/response_length/mean": 12.34}
    assert format_validation(one, 20) == "validation at step 20: score 0.250 | response length 12.3"
    two = {"val/score/mean": 0.5, "val/score/a": 0.25, "val/score/b": 0.75}
    assert format_validation(two, 0) == "validation at step 0: score 0.500 | a 0.250, b 0.750"


def test_worker_output_goes_to_the_run_directory_unless_verbose(monkeypatch, tmp_path):
    monkeypatch.delenv("BALLAST_VERBOSE", raising=False)
    assert not verbose_output() and worker_log_dir(str(tmp_path)) == os.path.join(str(tmp_path), "logs")
    for value, verbose in (("1", True), ("true", True), ("0", False), ("false", False), ("", False)):
        monkeypatch.setenv("BALLAST_VERBOSE", value)
        assert verbose_output() is verbose
        assert (worker_log_dir(str(tmp_path)) is None) is verbose
