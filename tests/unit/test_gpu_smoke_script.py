"""scripts/gpu_smoke.sh itself, run on this CPU machine against a simulated GPU machine.

The script only ever runs for real where there is a GPU, so its own logic (which log it searches for
NCCL lines, what it asks the benchmark to measure, how it turns results into PASS/FAIL) is checked
here: a copy of the script runs in a scratch repository whose `.venv/bin/python` is a stand-in that
records its arguments and produces what each real command would leave behind (a pytest summary, a run
directory with metrics and worker logs, a benchmark JSON), with a fake `nvidia-smi` listing two GPUs.
Anything else the script asks of python (its inline metric checks) runs on the real interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The stand-in for the repository's .venv/bin/python (its shebang is this test's interpreter).
FAKE_PYTHON = r'''
import json, os, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["SMOKE_CALLS"], "a") as f:
    f.write(json.dumps(args) + "\n")
if args[:1] == ["-c"] and "torch.cuda.is_available" in args[1]:
    sys.exit(0)  # "torch sees a CUDA device"
if args[:2] == ["-m", "pytest"]:
    print("3 passed, 2 skipped in 1.00s")
    sys.exit(0)
if args[:2] in (["-m", "ballast.models"],) or args[:1] == ["examples/data/make_synthetic.py"]:
    sys.exit(0)
if args[:2] == ["-m", "ballast.trainer.main"]:
    run = Path(next(a.split("=", 1)[1] for a in args if a.startswith("trainer.default_local_dir=")))
    (run / "logs").mkdir(parents=True)
    keys = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "training/rollout_actor_log_prob_diff/max")
    with open(run / "metrics.jsonl", "w") as f:
        for step in (1, 2, 3):
            f.write(json.dumps({"step": step, "timing_s/step": 1.5, **{k: 0.01 for k in keys}}) + "\n")
    print("ballast: training finished")  # the driver's own output: no NCCL lines
    for rank in range(int(next(a.split("=")[1] for a in args if a.startswith("trainer.n_gpus_per_node=")))):
        line = "NCCL INFO Init COMPLETE\n" if os.environ.get("SMOKE_WORKER_NCCL") == "1" else "worker ready\n"
        (run / "logs" / f"actor_rollout_ref_rank{rank}.log").write_text(line)
    sys.exit(0)
if args[:1] == ["benchmarks/engine_bench.py"]:
    out = args[args.index("--json") + 1]
    device = args[args.index("--device") + 1] if "--device" in args else "cpu"
    Path(out).write_text(json.dumps({"device": device, "static_tokens_per_s": 1.0, "dynamic_tokens_per_s": 2.0,
                                     "speedup": 2.0}))
    sys.exit(0)
os.execv(sys.executable, [sys.executable] + args)  # the script's inline checks: the real interpreter
'''

FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
if [[ "$1" == "-L" ]]; then
  echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"
  echo "GPU 1: NVIDIA H200 (UUID: GPU-1)"
else
  printf '143771\\n143771\\n'
fi
"""


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _run_smoke(tmp_path: Path, worker_nccl: bool):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_smoke.sh", repo / "scripts" / "gpu_smoke.sh")
    _executable(repo / "benchmarks" / "engine_bench.py", "")  # present: phase 3 runs
    _executable(repo / ".venv" / "bin" / "python", f"#!{sys.executable}\n{FAKE_PYTHON}")
    _executable(tmp_path / "bin" / "nvidia-smi", FAKE_NVIDIA_SMI)
    calls = tmp_path / "calls.jsonl"
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", SMOKE_CALLS=str(calls),
               SMOKE_WORKER_NCCL="1" if worker_nccl else "0", BALLAST_SMOKE_DIR=str(tmp_path / "out"))
    env.pop("BALLAST_VERBOSE", None)
    out = subprocess.run(["bash", str(repo / "scripts" / "gpu_smoke.sh")], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=120)
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    summary = {line.split()[0]: line for line in out.stdout.splitlines()
               if line.startswith(("pytest", "GRPO", "engine_bench"))}
    return out, recorded, summary


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_nccl_lines_are_looked_for_in_the_worker_logs_and_the_benchmark_runs_on_the_gpu(tmp_path):
    out, calls, summary = _run_smoke(tmp_path, worker_nccl=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in summary["GRPO"], summary  # NCCL lines only in <run>/logs/, none in the driver's log
    assert "NCCL INFO" not in (tmp_path / "out" / "grpo.log").read_text()
    trainer = next(c for c in calls if c[:2] == ["-m", "ballast.trainer.main"])
    assert "trainer.n_gpus_per_node=2" in trainer and "trainer.device=cuda" in trainer
    bench = next(c for c in calls if c[:1] == ["benchmarks/engine_bench.py"])
    assert bench[bench.index("--device") + 1] == "cuda", bench  # not the CPU benchmark on a GPU machine
    assert "PASS" in summary["engine_bench"] and "'device': 'cuda'" in summary["engine_bench"], summary
    pytest_call = next(c for c in calls if c[:2] == ["-m", "pytest"])
    assert pytest_call[-1] == "tests" and "gpu" in pytest_call


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_two_workers_without_any_nccl_line_fail_the_grpo_phase(tmp_path):
    out, _, summary = _run_smoke(tmp_path, worker_nccl=False)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL" in summary["GRPO"] and "no NCCL log lines" in summary["GRPO"], summary


def test_engine_bench_builds_its_engines_for_the_requested_device():
    """What the smoke's phase 3 asks for (`--device cuda`) reaches the engines of both modes."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("engine_bench", ROOT / "benchmarks" / "engine_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for mode in ("static", "dynamic"):
        args = SimpleNamespace(mode=mode, micro_batch_size=4, device="cuda")
        cfg, micro = bench.engine_setup(args, "/models/x", seq_len=100)
        assert cfg.device == "cuda" and cfg.use_remove_padding == (mode == "dynamic")
        assert (micro.max_token_len_per_gpu or micro.micro_batch_size_per_gpu * 100) == 400
