"""Off-policy overlap against the synchronous trainer, on exactly the same work.

Two measurements, each a set of whole `python -m ballast.trainer.main --config-name quickstart` runs
(the README's tiny GRPO task: real vLLM rollouts, 2 CPU workers):

* `--case io` (speed): the reward waits on I/O, as a remote verifier service does: every batch's
  scoring sleeps `--latency-s` in total (spread evenly over its samples; the driver's CPU is free
  meanwhile). Sync (`trainer.v1.trainer_mode=sync`) and each `--ahead` k (Ballast's colocated overlap,
  `trainer.ballast_overlap.batches_ahead=k`) run the same prompts, steps and seeds, interleaved `--repeats` times so a
  loaded machine affects them alike. Reported: the mean `timing_s/step` over the steps after
  `--warmup`, its phases, the idle ratios, and the ratio of each k to sync. `--split-ahead K,...` adds
  `separate_async` variants (`split_kK`): one trainer and one rollout worker on pools of their own
  instead of two colocated workers, the same two cores (the batched rollout, so without partial
  rollouts: `trainer.ballast_overlap.partial_rollout=false`; `parameter_sync_step` local updates of
  one quickstart mini-batch each).
* `--case learn` (learning): whole quickstart runs, sync vs k for every seed in `--seeds`, no reward
  latency; held-out (greedy) score at the start and at the end, and the mean training score of the
  last 10 steps.

    python benchmarks/off_policy_bench.py --case io --json outputs/off_policy_io.json
    python benchmarks/off_policy_bench.py --case learn --json outputs/off_policy_learn.json

* `--case partial` (partial rollouts): split pools, one batch ahead, request-level rollout whose
  conversations wait `--tool-s` on a stand-in tool between three sampled turns (so the trainer's update
  lands while they are in flight), with `trainer.ballast_overlap.partial_rollout` off and on,
  interleaved `--repeats` times: step time, how stale the tokens are (verl's trajectory_staleness from
  each sample's freshest tokens, _worst from its oldest, spans), the rollout-vs-trainer mismatch
  (`rollout_corr/k3_kl`) and the mid-call weight loads.

    python benchmarks/off_policy_bench.py --case partial --json outputs/off_policy_partial.json

* `--case model --metrics RUN/metrics.jsonl`: the speed-up model of docs/off_policy.md applied to
  a synchronous run's own phase times (any run: GPU or CPU, any size): the predicted step time and
  ratio with batches generated ahead on the same workers.

The compute-bound real-model comparison is step_bench's `--variant` (docs/off_policy.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_info  # noqa: E402
from step_bench import ROOT, _env, ensure_quickstart  # noqa: E402

REWARD_FILE = """\
import os, time
from ballast.data.rewards import default_compute_score
_PER_SAMPLE_S = float(os.environ["BALLAST_BENCH_REWARD_S_PER_SAMPLE"])
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(_PER_SAMPLE_S)  # a verifier service's round trip: the driver waits, its CPU is idle
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""
WAITING_LOOP_FILE = """\
import asyncio, os
from ballast.workers.agent_loop import AgentLoop, StopReason, Transcript
from ballast.workers.rollout.async_engine import TurnRequest
_TOOL_S = float(os.environ["BALLAST_BENCH_TOOL_S"])
class BenchWaitingLoop(AgentLoop):
    async def run(self, sample):  # three sampled turns; a stand-in tool call between them
        t = Transcript(sample.prompt_ids, with_log_probs=self.ctx.sampling.calculate_log_probs)
        for turn in range(3):
            if turn:
                await asyncio.sleep(_TOOL_S)
                t.add_inserted(self.ctx.stop_ids[:1])
            budget = min(self.ctx.budget(t), self.ctx.response_length // 4)
            if budget < 1:
                break
            out = await self.ctx.engine.generate(TurnRequest(t.ids, budget, sample.seed(turn)))
            t.add_sampled(out.token_ids, out.log_probs, out.versions)
        return t.output(StopReason.ANSWER, num_turns=5, info={"assistant_turns": 3.0})
"""
PHASES = ("step", "wait_rollout", "gen", "gen_workers", "reward", "update_actor", "old_log_prob", "update_weights",
          "export_weights")


QUICKSTART_MINI_BATCH = 8  # actor_rollout_ref.actor.ppo_mini_batch_size in configs/quickstart.yaml


def variant_overrides(ahead: int, split: bool = False, train_batch_size: int = 16) -> List[str]:
    if split:  # the quickstart's two cores: one trainer worker, one rollout worker
        return ["trainer.v1.trainer_mode=separate_async", f"trainer.v1.separate_async.num_warmup_batches={ahead}",
                f"trainer.v1.separate_async.parameter_sync_step={train_batch_size // QUICKSTART_MINI_BATCH}",
                "actor_rollout_ref.hybrid_engine=false", "trainer.n_gpus_per_node=1",
                "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]
    if ahead == 0:
        return ["trainer.v1.trainer_mode=sync"]
    return [f"trainer.ballast_overlap.batches_ahead={ahead}"]


def run(name: str, overrides: List[str], log_dir: str, env_extra: Dict[str, str]) -> List[dict]:
    """One quickstart run; its metrics rows (one per step, validation rows included)."""
    out = os.path.join(log_dir, name)
    env = _env(ROOT)
    env.update(env_extra)
    cmd = [sys.executable, "-m", "ballast.trainer.main", "--config-name", "quickstart", "trainer.resume_mode=disable",
           "trainer.move_old_run_aside=true", f"trainer.default_local_dir={out}", "trainer.save_freq=-1", *overrides]
    start = time.time()
    with open(os.path.join(log_dir, f"{name}.log"), "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    print(f"[off_policy_bench] {name}: {time.time() - start:.0f} s", flush=True)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def io_case(args, log_dir: str) -> dict:
    samples = args.train_batch_size * args.n
    reward = os.path.join(log_dir, "io_reward.py")
    with open(reward, "w") as f:
        f.write(REWARD_FILE)
    env = {"BALLAST_BENCH_REWARD_S_PER_SAMPLE": str(args.latency_s / samples)}
    common = [f"custom_reward_function.path={reward}", f"trainer.total_training_steps={args.warmup + args.steps}",
              "trainer.test_freq=-1", "trainer.val_before_train=false", f"data.train_batch_size={args.train_batch_size}",
              f"actor_rollout_ref.rollout.n={args.n}", *args.override]
    variants = {f"k{k}": variant_overrides(k) for k in [0] + args.ahead}
    # the batched rollout cannot be interrupted: the split variants keep each batch on its starting weights
    variants.update({f"split_k{k}": [*variant_overrides(k, True, args.train_batch_size),
                                     "trainer.ballast_overlap.partial_rollout=false"] for k in args.split_ahead})
    runs: Dict[str, List[dict]] = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, overrides in variants.items():
            rows = [row for row in run(f"io_{name}_r{r}", common + overrides, log_dir, env)
                    if "timing_s/step" in row][args.warmup:]
            runs[name].append({p: statistics.mean(row.get(f"timing_s/{p}", 0.0) for row in rows) for p in PHASES}
                           | {"response_length": statistics.mean(row["response_length/mean"] for row in rows)}
                           | {"trainer_idle_ratio": statistics.mean(row["perf/trainer_idle_ratio"] for row in rows),
                              "staleness_max": max(row.get("training/off_policy/trajectory_staleness/max", 0.0)
                                                   for row in rows)})
    summary = {}
    for name, reps in runs.items():
        summary[name] = {"s_per_step": statistics.median(x["step"] for x in reps), "repeats": reps}
    base = summary["k0"]["s_per_step"]
    for name in variants:
        if name != "k0":
            summary[name]["ratio_vs_sync"] = summary[name]["s_per_step"] / base
    # the model of docs/off_policy.md on the synchronous runs' own phase times, beside the measurement
    summary["k0"]["model"] = predict([{f"timing_s/{p}": rep[p] for p in PHASES} for rep in runs["k0"]])
    return {"work": {"config": "quickstart", "train_batch_size": args.train_batch_size, "n": args.n,
                     "reward_latency_s_per_batch": args.latency_s, "steps_measured": args.steps,
                     "warmup_steps": args.warmup, "overrides": args.override}, "variants": summary}


def partial_case(args, log_dir: str) -> dict:
    with open(os.path.join(log_dir, "bench_waiting_loop.py"), "w") as f:
        f.write(WAITING_LOOP_FILE)
    with open(os.path.join(log_dir, "loops.yaml"), "w") as f:
        f.write("- name: bench_waiting\n  _target_: bench_waiting_loop.BenchWaitingLoop\n")
    env = {"BALLAST_BENCH_TOOL_S": str(args.tool_s), "PYTHONPATH": os.pathsep.join([log_dir, ROOT])}
    common = [f"trainer.total_training_steps={args.warmup + args.steps}", "trainer.test_freq=-1",
              "trainer.val_before_train=false", f"data.train_batch_size={args.train_batch_size}",
              f"actor_rollout_ref.rollout.n={args.n}", "actor_rollout_ref.rollout.mode=async",
              f"actor_rollout_ref.rollout.agent.agent_loop_config_path={os.path.join(log_dir, 'loops.yaml')}",
              "actor_rollout_ref.rollout.agent.default_agent_loop=bench_waiting",
              *variant_overrides(1, True, args.train_batch_size), *args.override]
    keys = {"s_per_step": "timing_s/step", "gen_s": "timing_s/gen", "update_actor_s": "timing_s/update_actor",
            "update_weights_s": "timing_s/update_weights", "k3_kl": "rollout_corr/k3_kl",
            "staleness_mean": "training/off_policy/trajectory_staleness/mean",
            "staleness_worst_mean": "training/off_policy/trajectory_staleness_worst/mean",
            "spans_mean": "training/off_policy/trajectory_spans/mean",
            "mid_call_weight_loads": "rollout/partial/weight_loads"}
    runs: Dict[str, List[dict]] = {"partial_off": [], "partial_on": []}
    for r in range(args.repeats):
        for name in runs:
            flag = f"trainer.ballast_overlap.partial_rollout={name == 'partial_on'}"
            rows = [row for row in run(f"partial_{name}_r{r}", common + [flag], log_dir, env)
                    if "timing_s/step" in row][args.warmup:]
            runs[name].append({k: statistics.mean(row.get(key, 0.0) for row in rows) for k, key in keys.items()})
    summary = {name: {"median": {k: statistics.median(rep[k] for rep in reps) for k in keys}, "repeats": reps}
               for name, reps in runs.items()}
    summary["step_ratio_on_vs_off"] = summary["partial_on"]["median"]["s_per_step"] / \
        summary["partial_off"]["median"]["s_per_step"]
    return {"work": {"config": "quickstart", "placement": "separate_async k=1, 1 trainer + 1 rollout worker",
                     "rollout": "async, 3 sampled turns per conversation", "tool_s": args.tool_s,
                     "train_batch_size": args.train_batch_size, "n": args.n, "steps_measured": args.steps,
                     "warmup_steps": args.warmup, "overrides": args.override}, "variants": summary}


def learn_case(args, log_dir: str) -> dict:
    results: Dict[str, dict] = {}
    for seed in args.seeds:
        for k in [0] + args.ahead:
            seeds = [f"data.seed={seed}", f"trainer.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}"]
            rows = run(f"learn_k{k}_s{seed}", seeds + variant_overrides(k), log_dir, {})
            val = [r for r in rows if "val/score/mean" in r]
            train = [r for r in rows if "critic/score/mean" in r]
            results[f"k{k}_seed{seed}"] = {
                "val_first": val[0]["val/score/mean"], "val_last": val[-1]["val/score/mean"],
                "val_curve": [(r["step"], r["val/score/mean"]) for r in val],
                "train_score_last10": statistics.mean(r["critic/score/mean"] for r in train[-10:]),
                "s_per_step": statistics.mean(r["timing_s/step"] for r in train[2:]),
                "staleness_max": max(r.get("training/off_policy/trajectory_staleness/max", 0.0) for r in train)}
    return {"work": {"config": "quickstart (whole run)", "seeds": args.seeds}, "runs": results}


def predict(rows: List[dict]) -> dict:
    """The colocated overlap model on a synchronous run's step rows: G (the workers' generate call),
    U (the workers' training phases), R (scoring), O (the rest of the step: driver work on the critical
    path, minus what already overlapped). Synchronous: G + U + R + O; k >= 1 on the same workers:
    max(G + U, R) + max(O, 0), since scoring and the driver overlap the workers but G and U do not
    overlap each other."""
    def mean(key):
        return statistics.mean(r.get(key, 0.0) for r in rows)

    g = mean("timing_s/gen_workers") or mean("timing_s/gen")
    u = sum(mean(f"timing_s/{p}") for p in ("old_log_prob", "ref", "values", "update_critic", "update_actor"))
    r, step = mean("timing_s/reward"), mean("timing_s/step")
    o = step - (g + u + r)
    overlapped = max(g + u, r) + max(o, 0.0)
    return {"G_generate_s": g, "U_train_s": u, "R_score_s": r, "O_rest_s": o, "sync_step_s": step,
            "predicted_overlap_step_s": overlapped, "predicted_ratio": overlapped / step}


def model_case(args) -> dict:
    with open(args.metrics) as f:
        rows = [r for r in map(json.loads, f) if "timing_s/step" in r][args.warmup:]
    if not rows:
        raise SystemExit(f"{args.metrics}: no step rows after --warmup {args.warmup}")
    return {"metrics": args.metrics, "steps": len(rows), "model": predict(rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=("io", "learn", "model", "partial"), default="io")
    p.add_argument("--metrics", help="model: a synchronous run's metrics.jsonl")
    p.add_argument("--override", action="append", default=[],
                   help="io: an extra hydra override for every run (e.g. actor_rollout_ref.rollout.ignore_eos=True, "
                        "which makes every response max_response_length tokens: the same tokens in both modes)")
    p.add_argument("--ahead", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                   help="batches generated ahead (comma list), each compared with sync")
    p.add_argument("--split-ahead", type=lambda s: [int(x) for x in s.split(",")], default=[],
                   help="io: also run separate_async (split pools) with these k")
    p.add_argument("--latency-s", type=float, default=1.0, help="io: reward latency per batch")
    p.add_argument("--tool-s", type=float, default=0.5, help="partial: the stand-in tool's seconds per call")
    p.add_argument("--train-batch-size", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--log-dir", default=os.path.join(ROOT, "outputs", "off_policy_bench"))
    p.add_argument("--json", help="write the results here (also printed)")
    args = p.parse_args()
    if args.case == "model":
        print(json.dumps(model_case(args), indent=1))
        return
    ensure_quickstart()
    os.makedirs(args.log_dir, exist_ok=True)
    log_dir = tempfile.mkdtemp(prefix=f"{args.case}-", dir=args.log_dir)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {"platform": platform.platform(), "cpu": cpu_info(), "load_avg_start": os.getloadavg()},
              "case": args.case}
    cases = {"io": io_case, "learn": learn_case, "partial": partial_case}
    result.update(cases[args.case](args, log_dir))
    result["machine"]["load_avg_end"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
