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
import os
from typing import List

import readme_run
from readme_run import mean, median, step_rows

VARIANTS = {
    "on_policy": ["actor_rollout_ref.rollout.dtype=float32"],
    "uncorrected": ["actor_rollout_ref.rollout.dtype=bfloat16"],
    "corrected": ["actor_rollout_ref.rollout.dtype=bfloat16"],  # + the preset
}
# the README run's lr, with the rollout's own log-probs (the mismatch metrics need them)
COMMON = ["actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.actor.optim.lr=1e-5"]


def run(name: str, seed: int, args) -> dict:
    extra = list(VARIANTS[name]) + ([f"+algorithm/rollout_correction={args.preset}"] if name == "corrected" else [])
    log = os.path.join(args.log_dir, f"{name}_seed{seed}.log")
    rows, wall, code = readme_run.run_trainer(args, seed, COMMON + extra, log)
    steps = step_rows(rows)
    return {
        **readme_run.run_summary(name, seed, rows, wall, code, log, extra),
        "rollout_corr_kl": mean("rollout_corr/kl", steps), "rollout_corr_k3_kl": mean("rollout_corr/k3_kl", steps),
        "rollout_actor_log_prob_diff_mean": mean("training/rollout_actor_log_prob_diff/mean", steps),
        "rollout_is_mean": mean("rollout_corr/rollout_is_mean", steps),
        "rollout_is_ratio_fraction_high": mean("rollout_corr/rollout_is_ratio_fraction_high", steps),
        "s_per_step": median("timing_s/step", steps),
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
    readme_run.add_arguments(p, "rollout_correction_mismatch", "on_policy,uncorrected,corrected")
    p.add_argument("--preset", default="decoupled_token_is")
    args = p.parse_args()
    readme_run.resolve_task(args)
    results = readme_run.sweep(args, run, ("val_final", "rollout_corr_k3_kl", "s_per_step"),
                               lambda done: {"preset": args.preset, "steps": args.steps, "results": done})
    print(table(results))


if __name__ == "__main__":
    main()
