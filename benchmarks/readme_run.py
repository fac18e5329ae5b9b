"""The README's real-model run (examples/run_grpo_smollm2_cpu.sh: GRPO on SmolLM2-135M-Instruct's
arithmetic task) as a building block for experiments that compare variants of it over seeds
(benchmarks/rollout_correction_mismatch.py, benchmarks/lora_learning.py): its overrides, the shared
command-line arguments, one run as a subprocess with its metrics read back, the held-out summary,
and the sweep over variants and seeds with `--resume` of an interrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def overrides(model_dir: str, data_dir: str, seed: int, steps: int, test_freq: int, out_dir: str) -> List[str]:
    """examples/run_grpo_smollm2_cpu.sh's run for `steps` steps; its lr is the caller's to set."""
    return [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data_dir}/train.parquet",
        f"data.val_files={data_dir}/val.parquet", "data.max_prompt_length=64", "data.max_response_length=32",
        "data.train_batch_size=8", f"data.seed={seed}", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=4", f"actor_rollout_ref.rollout.seed={seed}", "actor_rollout_ref.rollout.block_size=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
        "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.use_prefix_grouper=True",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=1", "trainer.device=cpu", "trainer.n_gpus_per_node=2",
        "trainer.balance_batch=True", f"trainer.seed={seed}", "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={out_dir}", "trainer.resume_mode=disable", "trainer.val_before_train=True",
        f"trainer.test_freq={test_freq}", "trainer.save_freq=-1", f"trainer.total_training_steps={steps}",
    ]


def add_arguments(p: argparse.ArgumentParser, log_dir: str, variants: str) -> None:
    """The arguments every sweep of the README run takes."""
    p.add_argument("--model-dir", help="SmolLM2 float32 directory (default: ballast.models.from_gguf.real_model_dir)")
    p.add_argument("--data-dir", help="arithmetic task directory (default: written into .cache/data/arithmetic)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--test-freq", type=int, default=5)
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--variants", default=variants)
    p.add_argument("--log-dir", default=os.path.join(ROOT, "outputs", log_dir))
    p.add_argument("--json")
    p.add_argument("--resume", action="store_true", help="skip the runs --json already holds (exit code 0)")


def resolve_task(args: argparse.Namespace) -> None:
    """Fill in the default model (converted once per machine) and task (written once) directories."""
    if args.model_dir is None:
        from ballast.models.from_gguf import real_model_dir

        args.model_dir = str(real_model_dir("float32"))
    if args.data_dir is None:
        from ballast.data import write_arithmetic_dataset

        args.data_dir = os.path.join(os.environ.get("BALLAST_CACHE_DIR", os.path.join(ROOT, ".cache")), "data", "arithmetic")
        if not os.path.exists(os.path.join(args.data_dir, "val.parquet")):  # examples/run_grpo_smollm2_cpu.sh's task
            write_arithmetic_dataset(args.data_dir, train_size=512, val_size=64, seed=0, kinds=("add", "mul"),
                                     lo=2, hi=40, b_lo=2, b_hi=9)
    os.makedirs(args.log_dir, exist_ok=True)


def completed_runs(args: argparse.Namespace) -> List[dict]:
    """With --resume, the successful runs --json already holds (an interrupted sweep keeps them)."""
    if args.resume and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            return [r for r in json.load(f)["results"] if r["exit_code"] == 0]
    return []


def run_trainer(args: argparse.Namespace, seed: int, extra: List[str], log: str) -> Tuple[List[dict], float, int]:
    """One run of the trainer (the README run + `extra`) in a subprocess: (metrics rows, wall s, exit code)."""
    with tempfile.TemporaryDirectory(prefix="readme_run_") as tmp:
        out_dir = os.path.join(tmp, "run")
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   VLLM_CACHE_ROOT=os.path.join(tmp, "vllm"), TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TMPDIR=tmp, PYTHONPATH=ROOT)
        cmd = [sys.executable, "-m", "ballast.trainer.main",
               *overrides(args.model_dir, args.data_dir, seed, args.steps, args.test_freq, out_dir), *extra]
        start = time.perf_counter()
        with open(log, "w") as f:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - start
        rows = []
        path = os.path.join(out_dir, "metrics.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
    return rows, wall, proc.returncode


def step_rows(rows: List[dict]) -> List[dict]:
    return [r for r in rows if "timing_s/step" in r]


def mean(key: str, rows: List[dict]) -> Optional[float]:
    values = [r[key] for r in rows if key in r]
    return statistics.mean(values) if values else None


def median(key: str, rows: List[dict]) -> Optional[float]:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def run_summary(name: str, seed: int, rows: List[dict], wall: float, code: int, log: str, extra: List[str]) -> dict:
    """What every variant reports: identity, the held-out curve (start, final, best), the train score
    of the last half of the steps."""
    steps = step_rows(rows)
    val = [(r["step"], r["val/score/mean"]) for r in rows if "val/score/mean" in r]
    return {
        "variant": name, "seed": seed, "exit_code": code, "log": log, "overrides": extra, "wall_s": wall,
        "steps": len(steps), "val_curve": val, "val_final": val[-1][1] if val else None,
        "val_start": val[0][1] if val else None, "val_best": max(v for _, v in val) if val else None,
        "train_score_last_half": mean("critic/score/mean", steps[len(steps) // 2:]),
    }


def sweep(args: argparse.Namespace, run: Callable[[str, int, argparse.Namespace], dict], shown: Sequence[str],
          document: Callable[[List[dict]], dict]) -> List[dict]:
    """Run every (variant, seed) of `args` not already done (`--resume`), in seed order; print each
    result's `shown` keys as it ends and rewrite `--json` (`document(results)`) after every run, so a
    later failure keeps what ran. Returns all results."""
    results = completed_runs(args)
    done = {(r["variant"], r["seed"]) for r in results}
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in args.variants.split(","):
            if (name, seed) in done:
                continue
            results.append(run(name, seed, args))
            print(json.dumps({k: results[-1][k] for k in ("variant", "seed", "exit_code", *shown)}), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(document(results), f, indent=1)
    return results


def variant_runner(variants: Dict[str, List[str]], lr: float) -> Callable[[str, int, argparse.Namespace], dict]:
    """`run(name, seed, args)` for `sweep`: the README run at `lr` plus `variants[name]`'s overrides,
    summarised with its s/step and the update and generation seconds (medians over steps)."""
    def run(name: str, seed: int, args: argparse.Namespace) -> dict:
        if name not in variants:
            raise ValueError(f"unknown variant {name!r} ({', '.join(variants)})")
        extra = [f"actor_rollout_ref.actor.optim.lr={lr}", *variants[name]]
        log = os.path.join(args.log_dir, f"{name}_seed{seed}.log")
        rows, wall, code = run_trainer(args, seed, extra, log)
        steps = step_rows(rows)
        return {**run_summary(name, seed, rows, wall, code, log, extra),
                "s_per_step": median("timing_s/step", steps), "update_s": median("timing_s/update_actor", steps),
                "gen_s": median("timing_s/gen", steps)}
    return run


def final_gaps(results: List[dict], baseline: str) -> Dict[str, Dict[int, float]]:
    """Per variant other than `baseline`, per seed: its final held-out score minus the baseline's."""
    final = {(r["variant"], r["seed"]): r["val_final"] for r in results if r["val_final"] is not None}
    out: Dict[str, Dict[int, float]] = {}
    for (variant, seed), score in final.items():
        if variant != baseline and (baseline, seed) in final:
            out.setdefault(variant, {})[seed] = score - final[(baseline, seed)]
    return out


def variants_main(doc: str, log_dir: str, variants: Dict[str, List[str]], lr: float, baseline: str) -> None:
    """The command line of a learning comparison of `variants` of the README run (all by default) at
    `lr`: the sweep, its JSON (`results`, and `<variant>_minus_<baseline>`: final held-out score gaps
    per seed), printed as each run ends."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_arguments(p, log_dir, ",".join(variants))
    args = p.parse_args()
    resolve_task(args)
    document = lambda done: {"steps": args.steps, "results": done,  # noqa: E731
                             **{f"{v}_minus_{baseline}": g for v, g in final_gaps(done, baseline).items()}}
    results = sweep(args, variant_runner(variants, lr), ("val_curve", "s_per_step", "update_s", "gen_s"), document)
    print(f"final held-out score minus {baseline}'s, per variant and seed:", final_gaps(results, baseline))
