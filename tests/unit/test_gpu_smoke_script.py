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
if args[:1] == ["-c"] and "build_tool_calling_model" in args[1]:
    Path(args[2]).mkdir(parents=True)  # the tool-calling model's directory
    sys.exit(0)
if args[:2] == ["-m", "pytest"]:
    print("3 passed, 2 skipped in 1.00s")
    sys.exit(0)
if args[:2] in (["-m", "ballast.models"],) or args[:1] == ["examples/data/make_synthetic.py"]:
    sys.exit(0)
if args[:2] == ["-m", "ballast.trainer.main"]:
    run = Path(next(a.split("=", 1)[1] for a in args if a.startswith("trainer.default_local_dir=")))
    (run / "logs").mkdir(parents=True)
    keys = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "training/rollout_actor_log_prob_diff/max")
    # what the runs of phase 3 report: the weight-sync check, the export, partial rollouts' weight loads
    keys += ("rollout/sync_check/mean_abs_diff", "rollout/sync_check/tolerance", "rollout/sync_check/adapter_effect",
             "timing_s/export_weights")
    with open(run / "metrics.jsonl", "w") as f:
        for step in (1, 2, 3):
            f.write(json.dumps({"step": step, "timing_s/step": 1.5, "training/off_policy/trajectory_spans/max": 2,
                                "rollout/partial/weight_loads": 1.0, "agent/tool_calls/total": 8.0,
                                "agent/tool_errors/total": 0.0, **{k: 0.01 for k in keys}}) + "\n")
    if any(a.startswith("actor_rollout_ref.model.lora_rank=") for a in args):
        print("[ballast] LoRA weight sync: adapter only (rank 8)")
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
  [[ "${SMOKE_GPUS:-2}" == 1 ]] || echo "GPU 1: NVIDIA H200 (UUID: GPU-1)"
else
  printf '143771\\n143771\\n'
fi
"""


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _run_smoke(tmp_path: Path, worker_nccl: bool, gpus: int = 2, fake_python: str = FAKE_PYTHON):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_smoke.sh", repo / "scripts" / "gpu_smoke.sh")
    _executable(repo / "benchmarks" / "engine_bench.py", "")  # present: phase 3 runs
    _executable(repo / ".venv" / "bin" / "python", f"#!{sys.executable}\n{fake_python}")
    _executable(tmp_path / "bin" / "nvidia-smi", FAKE_NVIDIA_SMI)
    calls = tmp_path / "calls.jsonl"
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", SMOKE_CALLS=str(calls),
               SMOKE_WORKER_NCCL="1" if worker_nccl else "0", BALLAST_SMOKE_DIR=str(tmp_path / "out"),
               SMOKE_GPUS=str(gpus))
    env.pop("BALLAST_VERBOSE", None)
    out = subprocess.run(["bash", str(repo / "scripts" / "gpu_smoke.sh")], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=120)
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    summary = {line.split()[0]: line for line in out.stdout.splitlines()
               if line.startswith(("pytest", "GRPO", "engine_bench", "LoRA", "split", "async", "rollout"))}
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


def _trainer_calls(calls):
    return [c for c in calls if c[:2] == ["-m", "ballast.trainer.main"]]


def _run_of(calls, override):
    return next(c for c in _trainer_calls(calls) if override in c)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_lora_split_pool_async_and_tp_runs_each_get_their_overrides_and_pass(tmp_path):
    out, calls, summary = _run_smoke(tmp_path, worker_nccl=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(_trainer_calls(calls)) == 5  # phase 2's GRPO and the four runs of phase 3
    for name in ("LoRA", "split", "async", "rollout"):
        assert "PASS" in summary[name], summary
    lora = _run_of(calls, "actor_rollout_ref.model.lora_rank=8")
    assert "trainer.n_gpus_per_node=2" in lora and "trainer.device=cuda" in lora
    split = _run_of(calls, "trainer.v1.separate_async.num_warmup_batches=0")
    assert "trainer.v1.trainer_mode=separate_async" in split and "actor_rollout_ref.rollout.mode=async" not in split
    interrupted = _run_of(calls, "actor_rollout_ref.rollout.mode=async")
    assert "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent" in interrupted
    assert not any(a.startswith("trainer.ballast_overlap.partial_rollout=") for a in interrupted)  # verl's default
    # the tool-calling model is built before the run, and the run trains it (the last model.path wins)
    build = next(i for i, c in enumerate(calls) if c[:1] == ["-c"] and "build_tool_calling_model" in c[1])
    assert build < calls.index(interrupted) and calls[build][2] == str(tmp_path / "out" / "tool_model")
    paths = [a for a in interrupted if a.startswith("actor_rollout_ref.model.path=")]
    assert paths[-1] == f"actor_rollout_ref.model.path={tmp_path / 'out' / 'tool_model'}"
    assert "testkit.agent.SlowCalculatorTool" in (tmp_path / "out" / "tools.yaml").read_text()
    tp = _run_of(calls, "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert "trainer.n_gpus_per_node=2" in tp
    for run in _trainer_calls(calls):  # each run in a directory of its own
        assert sum(a.startswith("trainer.default_local_dir=") for a in run) == 1
    assert len({next(a for a in run if a.startswith("trainer.default_local_dir=")) for run in _trainer_calls(calls)}) == 5


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_on_one_gpu_the_two_gpu_runs_are_skipped_not_failed(tmp_path):
    out, calls, summary = _run_smoke(tmp_path, worker_nccl=True, gpus=1)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in summary["LoRA"] and "trainer.n_gpus_per_node=1" in _run_of(calls, "actor_rollout_ref.model.lora_rank=8")
    for name in ("split", "async", "rollout"):
        assert "SKIP" in summary[name] and "needs 2 GPUs, this machine has 1" in summary[name], summary
    assert len(_trainer_calls(calls)) == 2


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_run_whose_metrics_miss_what_it_exists_for_fails(tmp_path):
    """The async run must show a request interrupted by new weights (two versions in one trajectory) and
    tool calls that were answered."""
    broken = [('"training/off_policy/trajectory_spans/max": 2', '"training/off_policy/trajectory_spans/max": 1'),
              ('"agent/tool_calls/total": 8.0', '"agent/tool_calls/total": 0.0'),
              ('"agent/tool_errors/total": 0.0', '"agent/tool_errors/total": 2.0')]
    for i, (before, after) in enumerate(broken):
        fake = FAKE_PYTHON.replace(before, after)
        assert fake != FAKE_PYTHON
        out, _, summary = _run_smoke(tmp_path / str(i), worker_nccl=True, fake_python=fake)
        assert out.returncode == 1 and "FAIL" in summary["async"] and "PASS" in summary["LoRA"], (after, summary)


def _phase3_arrays(out_dir: Path) -> dict:
    """COMMON and each run's overrides as bash expands them (phase 2's values for its variables; the
    files phase 3 writes, in `out_dir`)."""
    script = (ROOT / "scripts" / "gpu_smoke.sh").read_text()
    block = script[script.index("COMMON=("):script.index("smoke_run() {")]
    names = ("COMMON", "LORA_RUN", "SPLIT_RUN", "ASYNC_RUN", "TP_RUN")
    dump = "; ".join(f'printf "%s\\0" "@{n}" "${{{n}[@]}}"' for n in names)
    prelude = f"OUT={out_dir} WORKERS=2 KV_BYTES=67108864 RUN_S=300\n"
    out = subprocess.run(["bash", "-c", prelude + block + "\n" + dump], capture_output=True, text=True, check=True)
    arrays, current = {}, None
    for item in out.stdout.split("\0")[:-1]:
        if item.startswith("@"):
            current = arrays.setdefault(item[1:], [])
        else:
            current.append(item)
    return arrays


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("run", ["LORA_RUN", "SPLIT_RUN", "ASYNC_RUN", "TP_RUN"])
def test_each_phase3_run_is_a_valid_config_that_plans(run, tmp_path):
    """The runs only ever happen on a GPU machine: their overrides are checked here as far as a CPU can
    (the config loads, the run plans: sizes, worker specs, the off-policy mode), and the colocated ones
    fit an H200 beside vLLM."""
    from ballast.trainer.config import load_config
    from ballast.trainer.config.gpu_memory import check_rollout_gpu_memory
    from ballast.tools.registry import load_tools
    from ballast.trainer.config.off_policy import overlap, split_pools
    from ballast.trainer.run.run_plan import plan_run
    from testkit.agent import SlowCalculatorTool

    arrays = _phase3_arrays(tmp_path)
    cfg = load_config([*arrays["COMMON"], f"trainer.default_local_dir={tmp_path / 'run'}", *arrays[run]])
    plan = plan_run(cfg, None, total_steps=cfg.trainer.total_training_steps)
    spec = plan.specs.actor_rollout_ref
    if run == "LORA_RUN":
        assert spec.rollout.max_lora_rank == 8 and spec.weight_sync.check  # adapter-only sync, checked
    if run in ("SPLIT_RUN", "ASYNC_RUN"):
        assert split_pools(cfg) and plan.specs.rollout is not None and spec.weight_sync.check
    if run == "ASYNC_RUN":  # tool_agent conversations with the slow calculator, interrupted by new weights
        assert plan.specs.rollout.agent is not None and plan.specs.rollout.rollout is not None
        assert plan.specs.rollout.agent.default_agent_loop == "tool_agent" and overlap(cfg).partial_rollout
        tools = load_tools(cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path)
        assert isinstance(tools["calculator"], SlowCalculatorTool) and tools["calculator"].config["delay_s"] == 2
    if run == "TP_RUN":
        assert spec.rollout.tensor_model_parallel_size == 2
    if not split_pools(cfg):
        check_rollout_gpu_memory(cfg, 460_000, 141 * 10**9)  # the tiny preset: well under a million parameters
