"""Does a LoRA adapter learn as much as the full fine-tune? GRPO on SmolLM2-135M-Instruct's arithmetic
task (the README's real-model run, examples/run_grpo_smollm2_cpu.sh), same steps, same seeds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lora_learning.py --steps 10 --seeds 1,2 --json out.json

Variants, each for every seed, run one after another:

* `full`: the README run as it is (full fine-tuning, lr `--full-lr`, default 1e-5);
* `lora`: the same run training a rank `--rank` adapter on every linear layer (alpha `--alpha`,
  default 2 x rank) at lr `--lora-lr` (default 2e-4), adapter-only sync into vLLM with the
  weight-sync check on (the default for LoRA runs).

Each run logs the held-out greedy score (`val/score/mean`, 64 questions, at step 0, every
`--test-freq` steps and at the end). The summary gives, per variant and seed, the held-out curve,
final and best score, the mean train score of the last half of the steps, s/step, the weight-sync
time, the worst weight-sync check difference, and the rank-0 worker's peak resident memory; then,
per LoRA learning rate and seed, LoRA's final held-out score minus the full fine-tune's. A run is
identified by (variant, seed, lr): `--resume` keeps the completed runs `--json` already holds and
adds the others, so a second sweep at another `--lora-lr` extends the same file.
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
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def overrides(model_dir: str, data_dir: str, seed: int, steps: int, test_freq: int, out_dir: str) -> List[str]:
    """examples/run_grpo_smollm2_cpu.sh's run for `steps` steps (its lr is set per variant)."""
    return [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data_dir}/train.parquet",
        f"data.val_files={data_dir}/val.parquet", "data.max_prompt_length=64", "data.max_response_length=32",
        "data.train_batch_size=8", f"data.seed={seed}", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=4", f"actor_rollout_ref.rollout.seed={seed}", "actor_rollout_ref.rollout.block_size=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
        "actor_rollout_ref.model.use_remove_padding=True", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=1", "trainer.device=cpu", "trainer.n_gpus_per_node=2",
        "trainer.balance_batch=True", f"trainer.seed={seed}", "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={out_dir}", "trainer.resume_mode=disable", "trainer.val_before_train=True",
        f"trainer.test_freq={test_freq}", "trainer.save_freq=-1", f"trainer.total_training_steps={steps}",
    ]


def variant_overrides(name: str, args) -> List[str]:
    if name == "full":
        return [f"actor_rollout_ref.actor.optim.lr={args.full_lr}"]
    if name == "lora":
        alpha = args.alpha if args.alpha is not None else 2 * args.rank
        return [f"actor_rollout_ref.actor.optim.lr={args.lora_lr}", f"actor_rollout_ref.model.lora_rank={args.rank}",
                f"actor_rollout_ref.model.lora_alpha={alpha}", "actor_rollout_ref.model.target_modules=all-linear"]
    raise ValueError(f"unknown variant {name!r} (full, lora)")


def run_lr(result: dict) -> float:
    """The learning rate a run used (from its overrides)."""
    key = "actor_rollout_ref.actor.optim.lr="
    return float(next(o for o in result["overrides"] if o.startswith(key))[len(key):])


def run(name: str, seed: int, args, log_dir: str) -> dict:
    extra = variant_overrides(name, args)
    with tempfile.TemporaryDirectory(prefix="lora_learning_") as tmp:
        out_dir = os.path.join(tmp, "run")
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", RAY_AUTH_MODE="disabled",
                   RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   VLLM_CACHE_ROOT=os.path.join(tmp, "vllm"), TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TMPDIR=tmp, PYTHONPATH=ROOT)
        cmd = [sys.executable, "-m", "ballast.trainer.main",
               *overrides(args.model_dir, args.data_dir, seed, args.steps, args.test_freq, out_dir), *extra]
        log = os.path.join(log_dir, f"{name}_seed{seed}_lr{extra[0].rpartition('=')[2]}.log")
        start = time.perf_counter()
        with open(log, "w") as f:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - start
        rows = []
        path = os.path.join(out_dir, "metrics.jsonl")
        if os.path.exists(path):
            rows = [json.loads(line) for line in open(path) if line.strip()]
    return summarise(name, seed, rows, wall, proc.returncode, log, extra)


def summarise(name: str, seed: int, rows: List[dict], wall: float, code: int, log: str, extra: List[str]) -> dict:
    steps = [r for r in rows if "timing_s/step" in r]
    val = [(r["step"], r["val/score/mean"]) for r in rows if "val/score/mean" in r]
    half = steps[len(steps) // 2:]

    def med(key: str, rs: List[dict]) -> Optional[float]:
        values = [r[key] for r in rs if key in r]
        return statistics.median(values) if values else None

    def mean(key: str, rs: List[dict]) -> Optional[float]:
        values = [r[key] for r in rs if key in r]
        return statistics.mean(values) if values else None

    check = [r["rollout/sync_check/mean_abs_diff"] for r in steps if "rollout/sync_check/mean_abs_diff" in r]
    return {
        "variant": name, "seed": seed, "exit_code": code, "log": log, "overrides": extra, "wall_s": wall,
        "steps": len(steps), "val_curve": val, "val_final": val[-1][1] if val else None,
        "val_start": val[0][1] if val else None, "val_best": max(v for _, v in val) if val else None,
        "train_score_last_half": mean("critic/score/mean", half),
        "s_per_step": med("timing_s/step", steps), "update_s": med("timing_s/update_actor", steps),
        "weight_sync_s": med("timing_s/update_weights", steps),
        "sync_check_max_abs_diff": max(check) if check else None,
        "rollout_probs_diff_max": max((r["training/rollout_probs_diff_max"] for r in steps
                                       if "training/rollout_probs_diff_max" in r), default=None),
        "max_rss_gb": steps[-1].get("perf/max_rss_gb") if steps else None,
    }


def gaps(results: List[dict]) -> Dict[str, Dict[int, float]]:
    """Per LoRA learning rate, per seed: LoRA's final held-out score minus the full fine-tune's."""
    full = {r["seed"]: r["val_final"] for r in results if r["variant"] == "full" and r["val_final"] is not None}
    out: Dict[str, Dict[int, float]] = {}
    for r in results:
        if r["variant"] == "lora" and r["val_final"] is not None and r["seed"] in full:
            out.setdefault(f"lr={run_lr(r):g}", {})[r["seed"]] = r["val_final"] - full[r["seed"]]
    return out


def table(results: List[dict]) -> str:
    head = ("| variant | lr | seed | held-out score (step: score) | final | train score, last half | s/step | update s | "
            "weight sync s | peak RSS rank 0 (GB) |")
    lines = [head, "|" + "---|" * 10]
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    for r in results:
        curve = ", ".join(f"{s}: {v:.3f}" for s, v in r["val_curve"])
        lines.append(f"| {r['variant']} | {run_lr(r):g} | {r['seed']} | {curve} | **{fmt(r['val_final'], '.3f')}** | "
                     f"{fmt(r['train_score_last_half'], '.3f')} | {fmt(r['s_per_step'], '.1f')} | "
                     f"{fmt(r['update_s'], '.1f')} | {fmt(r['weight_sync_s'], '.3f')} | {fmt(r['max_rss_gb'], '.2f')} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="SmolLM2 float32 directory (default: ballast.models.from_gguf.real_model_dir)")
    p.add_argument("--data-dir", help="arithmetic task directory (default: written into .cache/data/arithmetic)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--test-freq", type=int, default=5)
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--variants", default="full,lora")
    p.add_argument("--full-lr", type=float, default=1e-5)
    p.add_argument("--lora-lr", type=float, default=2e-4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, help="lora_alpha (default: 2 x rank)")
    p.add_argument("--log-dir", default=os.path.join(ROOT, "outputs", "lora_learning"))
    p.add_argument("--json")
    p.add_argument("--resume", action="store_true", help="skip the runs --json already holds (exit code 0)")
    args = p.parse_args()
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
    results: List[Dict] = []
    if args.resume and args.json and os.path.exists(args.json):  # keep the completed runs of an interrupted sweep
        results = [r for r in json.load(open(args.json))["results"] if r["exit_code"] == 0]
    done = {(r["variant"], r["seed"], run_lr(r)) for r in results}
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in args.variants.split(","):
            lr = args.full_lr if name == "full" else args.lora_lr
            if (name, seed, lr) in done:
                continue
            results.append(run(name, seed, args, args.log_dir))
            print(json.dumps({k: results[-1][k] for k in ("variant", "seed", "exit_code", "val_curve", "s_per_step")}),
                  flush=True)
            if args.json:  # after every run: a later failure keeps what ran
                with open(args.json, "w") as f:
                    json.dump({"steps": args.steps, "rank": args.rank, "results": results,
                               "lora_minus_full": gaps(results)}, f, indent=1)
    print(table(results))
    print("LoRA final held-out score minus full fine-tune's, per LoRA lr and seed:", gaps(results))


if __name__ == "__main__":
    main()
