"""Does rollout correction matter? GRPO on SmolLM2-135M-Instruct's arithmetic task (the README's real
model run, examples/run_grpo_smollm2_cpu.sh) with a real rollout/training mismatch: the vLLM rollout
runs in bfloat16 while the trainer computes in float32 (verl's motivating case: an inference engine
in another precision than training).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rollout_correction_mismatch.py --steps 10 --seeds 1,2 \
        --json out.json

Variants, each for every seed, run one after another:

* `on_policy`: rollout in float32 (the trainer's precision): the reference without mismatch;
* `uncorrected`: rollout in bfloat16, no correction (the `rollout_corr/*` metrics only);
* `corrected`: rollout in bfloat16 with `--preset` (default `decoupled_token_is`: token-level TIS).

Every run logs the rollout-vs-trainer mismatch (`rollout_corr/kl`, `rollout_corr/k3_kl`: the rollout's
log-probs against the trainer's old log-probs of the same tokens) and the held-out greedy score
(`val/score/mean`, 64 questions, at step 0, every `--test-freq` steps and at the end). The summary
gives, per variant and seed, the final and best held-out score, the mean train score of the last half
of the steps, the mean mismatch over the steps and s/step, as JSON and as a markdown table.
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
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "on_policy": ["actor_rollout_ref.rollout.dtype=float32"],
    "uncorrected": ["actor_rollout_ref.rollout.dtype=bfloat16"],
    "corrected": ["actor_rollout_ref.rollout.dtype=bfloat16"],  # + the preset
}


def overrides(model_dir: str, data_dir: str, seed: int, steps: int, test_freq: int, out_dir: str) -> List[str]:
    """examples/run_grpo_smollm2_cpu.sh's run, with the rollout's log-probs and `steps` steps."""
    return [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data_dir}/train.parquet",
        f"data.val_files={data_dir}/val.parquet", "data.max_prompt_length=64", "data.max_response_length=32",
        "data.train_batch_size=8", f"data.seed={seed}", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=4", f"actor_rollout_ref.rollout.seed={seed}", "actor_rollout_ref.rollout.block_size=32",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.optim.lr=1e-5",
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
        "actor_rollout_ref.model.use_remove_padding=True", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=1", "trainer.device=cpu", "trainer.n_gpus_per_node=2",
        "trainer.balance_batch=True", f"trainer.seed={seed}", "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={out_dir}", "trainer.resume_mode=disable", "trainer.val_before_train=True",
        f"trainer.test_freq={test_freq}", "trainer.save_freq=-1", f"trainer.total_training_steps={steps}",
    ]


def run(name: str, seed: int, args, log_dir: str) -> dict:
    extra = list(VARIANTS[name]) + ([f"+algorithm/rollout_correction={args.preset}"] if name == "corrected" else [])
    with tempfile.TemporaryDirectory(prefix="rollcorr_") as tmp:
        out_dir = os.path.join(tmp, "run")
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", RAY_AUTH_MODE="disabled",
                   RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   VLLM_CACHE_ROOT=os.path.join(tmp, "vllm"), TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TMPDIR=tmp, PYTHONPATH=ROOT)
        cmd = [sys.executable, "-m", "ballast.trainer.main",
               *overrides(args.model_dir, args.data_dir, seed, args.steps, args.test_freq, out_dir), *extra]
        log = os.path.join(log_dir, f"{name}_seed{seed}.log")
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
    mean = lambda key, rs: statistics.mean(r[key] for r in rs) if rs and key in rs[0] else None  # noqa: E731
    half = steps[len(steps) // 2:]
    return {
        "variant": name, "seed": seed, "exit_code": code, "log": log, "overrides": extra, "wall_s": wall,
        "steps": len(steps), "val_curve": val, "val_final": val[-1][1] if val else None,
        "val_start": val[0][1] if val else None, "val_best": max(v for _, v in val) if val else None,
        "train_score_last_half": mean("critic/score/mean", half),
        "rollout_corr_kl": mean("rollout_corr/kl", steps), "rollout_corr_k3_kl": mean("rollout_corr/k3_kl", steps),
        "rollout_actor_log_prob_diff_mean": mean("training/rollout_actor_log_prob_diff/mean", steps),
        "rollout_is_mean": mean("rollout_corr/rollout_is_mean", steps),
        "rollout_is_ratio_fraction_high": mean("rollout_corr/rollout_is_ratio_fraction_high", steps),
        "s_per_step": statistics.median(r["timing_s/step"] for r in steps) if steps else None,
    }


def table(results: List[dict]) -> str:
    head = ("| variant | seed | held-out score start -> final (best) | train score, last half | "
            "rollout-vs-actor kl | k3_kl | IS weight mean | s/step |")
    lines = [head, "|" + "---|" * 8]
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    for r in results:
        lines.append(f"| {r['variant']} | {r['seed']} | {fmt(r['val_start'], '.3f')} -> {fmt(r['val_final'], '.3f')} "
                     f"({fmt(r['val_best'], '.3f')}) | {fmt(r['train_score_last_half'], '.3f')} | "
                     f"{fmt(r['rollout_corr_kl'], '.2e')} | {fmt(r['rollout_corr_k3_kl'], '.2e')} | "
                     f"{fmt(r['rollout_is_mean'], '.4f')} | {fmt(r['s_per_step'], '.1f')} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="SmolLM2 float32 directory (default: ballast.models.from_gguf.real_model_dir)")
    p.add_argument("--data-dir", help="arithmetic task directory (default: written into .cache/data/arithmetic)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--test-freq", type=int, default=5)
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--variants", default="on_policy,uncorrected,corrected")
    p.add_argument("--preset", default="decoupled_token_is")
    p.add_argument("--log-dir", default=os.path.join(ROOT, "outputs", "rollout_correction_mismatch"))
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
    done = {(r["variant"], r["seed"]) for r in results}
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in args.variants.split(","):
            if (name, seed) in done:
                continue
            results.append(run(name, seed, args, args.log_dir))
            print(json.dumps({k: results[-1][k] for k in ("variant", "seed", "exit_code", "val_final",
                                                          "rollout_corr_k3_kl", "s_per_step")}), flush=True)
            if args.json:  # after every run: a later failure keeps what ran
                with open(args.json, "w") as f:
                    json.dump({"preset": args.preset, "steps": args.steps, "results": results}, f, indent=1)
    print(table(results))


if __name__ == "__main__":
    main()
