"""benchmarks/step_bench.py's Ballast command line is a valid config for every case it builds: its
overrides pass the trainer's loader, and `--bf16` reaches the engines through verl's precision keys
(the bench's "same work, both in bf16" claim rests on them)."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from ballast.trainer.config import load_config, role_precision

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_bench.py"
_spec = importlib.util.spec_from_file_location("step_bench", SCRIPT)
step_bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("step_bench", step_bench)  # its dataclasses look their module up while being built
_spec.loader.exec_module(step_bench)


def _cases(bf16: bool):
    args = argparse.Namespace(cases="quickstart,real", real_model_dir="/models/smollm2", real_train_file="/d/t.parquet",
                              real_prompts=8, real_n=4, real_max_new_tokens=32, real_max_prompt_length=256,
                              real_optimizer_steps=1, real_lr=1e-6, real_max_token_len=4096, real_reward=None,
                              real_whole_run_steps=30, bf16=bf16)
    return step_bench.build_cases(args)


def test_the_bench_config_loads_and_bf16_reaches_the_actor_and_the_rollout(tmp_path):
    for bf16 in (False, True):
        for case in _cases(bf16):
            assert case.bf16 is bf16
            cfg = load_config(step_bench.ballast_overrides(case, steps=4, workers=2, out_dir=str(tmp_path / "run")))
            assert role_precision(cfg, "actor") == ("bf16" if bf16 else "auto")
            assert cfg.actor_rollout_ref.rollout.dtype == ("bfloat16" if bf16 else "auto")
            assert cfg.data.train_batch_size == case.prompts_per_step


def test_threads_per_worker_keeps_the_cores_and_moves_them_into_each_process(tmp_path):
    for case in _cases(False):
        for threads, processes in ((1, 2), (2, 1)):
            cfg = load_config(step_bench.ballast_overrides(case, steps=4, workers=2, out_dir=str(tmp_path / "run"),
                                                           threads_per_worker=threads))
            t = cfg.trainer
            assert (t.n_gpus_per_node, t.cpus_per_worker) == (processes, threads)
            assert t.n_gpus_per_node * t.cpus_per_worker == 2  # the cores TRL gets


def test_a_missing_trl_is_named_before_any_run(tmp_path, monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(step_bench.importlib.util, "find_spec",
                        lambda name, *a: None if name == "trl" else real_find_spec(name, *a))

    def no_measurement(*args):
        raise AssertionError("the bench started measuring before checking for TRL")

    monkeypatch.setattr(step_bench, "matmul_peak_flops", no_measurement)
    monkeypatch.setattr(sys, "argv", ["step_bench.py", "--systems", "ballast,trl", "--log-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as info:
        step_bench.main()
    assert info.value.code == 2
    assert "setup.sh --bench" in capsys.readouterr().err
