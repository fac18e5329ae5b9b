"""Does bf16 compute learn as the fp32 default does? The README's real-model run (GRPO on SmolLM2-135M-
Instruct's arithmetic task, examples/run_grpo_smollm2_cpu.sh), same steps, same seeds, in two variants:

* `fp32`: the run as it is (fp32 training, fp32 vLLM rollout);
* `bf16`: `actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16` (bf16 compute, fp32
  master weights and AdamW states) and `actor_rollout_ref.rollout.dtype=bfloat16`;
* `bf16_train`: the same bf16 training with the fp32 vLLM rollout (which also scores the held-out set).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/precision_learning.py --steps 10 --seeds 1,2 --json out.json

Per variant and seed: the held-out greedy score curve (`val/score/mean`, each variant evaluated by its
own rollout engine, so the step-0 scores of the two differ by the rollout's precision alone), the
mean train score of the last half of the steps, s/step and the update and generation seconds; then,
per bf16 variant and seed, its final held-out score minus fp32's. `--resume` keeps the runs `--json` already holds.
"""

from __future__ import annotations

import argparse
import os
from typing import Dict, List

import readme_run
from readme_run import median, step_rows

LR = 1e-5  # the README run's
VARIANTS = {
    "fp32": [],
    "bf16": ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
             "actor_rollout_ref.rollout.dtype=bfloat16"],
    "bf16_train": ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"],
}


def run(name: str, seed: int, args) -> dict:
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r} ({', '.join(VARIANTS)})")
    extra = [f"actor_rollout_ref.actor.optim.lr={LR}", *VARIANTS[name]]
    log = os.path.join(args.log_dir, f"{name}_seed{seed}.log")
    rows, wall, code = readme_run.run_trainer(args, seed, extra, log)
    steps = step_rows(rows)
    return {**readme_run.run_summary(name, seed, rows, wall, code, log, extra),
            "s_per_step": median("timing_s/step", steps), "update_s": median("timing_s/update_actor", steps),
            "gen_s": median("timing_s/gen", steps)}


def gaps(results: List[dict]) -> Dict[str, Dict[int, float]]:
    """Per bf16 variant, per seed: its final held-out score minus fp32's."""
    final = {(r["variant"], r["seed"]): r["val_final"] for r in results if r["val_final"] is not None}
    out: Dict[str, Dict[int, float]] = {}
    for (variant, seed), score in final.items():
        if variant != "fp32" and ("fp32", seed) in final:
            out.setdefault(variant, {})[seed] = score - final[("fp32", seed)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    readme_run.add_arguments(p, "precision_learning", "fp32,bf16_train,bf16")
    args = p.parse_args()
    readme_run.resolve_task(args)
    results = readme_run.sweep(args, run, ("val_curve", "s_per_step", "update_s", "gen_s"),
                               lambda done: {"steps": args.steps, "results": done, "bf16_minus_fp32": gaps(done)})
    print("final held-out score minus fp32's, per variant and seed:", gaps(results))


if __name__ == "__main__":
    main()
