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
from typing import Dict, List

import readme_run
from readme_run import median, step_rows


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


def run(name: str, seed: int, args) -> dict:
    extra = variant_overrides(name, args)
    log = os.path.join(args.log_dir, f"{name}_seed{seed}_lr{extra[0].rpartition('=')[2]}.log")
    rows, wall, code = readme_run.run_trainer(args, seed, extra, log)
    steps = step_rows(rows)
    check = [r["rollout/sync_check/mean_abs_diff"] for r in steps if "rollout/sync_check/mean_abs_diff" in r]
    return {
        **readme_run.run_summary(name, seed, rows, wall, code, log, extra),
        "s_per_step": median("timing_s/step", steps), "update_s": median("timing_s/update_actor", steps),
        "weight_sync_s": median("timing_s/update_weights", steps),
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
    readme_run.add_arguments(p, "lora_learning", "full,lora")
    p.add_argument("--full-lr", type=float, default=1e-5)
    p.add_argument("--lora-lr", type=float, default=2e-4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, help="lora_alpha (default: 2 x rank)")
    args = p.parse_args()
    readme_run.resolve_task(args)
    results = readme_run.completed_runs(args)
    done = {(r["variant"], r["seed"], run_lr(r)) for r in results}
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in args.variants.split(","):
            lr = args.full_lr if name == "full" else args.lora_lr
            if (name, seed, lr) in done:
                continue
            results.append(run(name, seed, args))
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
