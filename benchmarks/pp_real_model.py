"""The real model through a pipeline: GRPO on SmolLM2-135M-Instruct (30 layers, tied embeddings) with the
actor and the reference cut into two stages (pp=2, dp=1 on the two workers) against the same run
without a pipeline (pp=1, dp=2), same seeds; per-step metrics of both and their largest differences.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pp_real_model.py --json out.json [--steps 5]

The run is the README's (examples/run_grpo_smollm2_cpu.sh: arithmetic, 8 prompts x 4 samples, vLLM
rollouts, dynamic batch size with a 1024-token budget, two mini-batches per step, so the second one's
old log-probs come from a forward-only pass) with a KL loss against the reference model and without
`use_prefix_grouper` (its shared-prompt forward does not run through a pipeline), no validation.
Each run takes about 10 GB; they run one after the other. Compared: every logged metric except
timings, throughput, memory and the per-rank balance figures (those depend on dp by design).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import readme_run  # noqa: E402
from machine import cpu_info  # noqa: E402

PP2 = ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"]
# What differs between the two layouts by design (each rank's share, wall time, memory), or is the
# pipeline's own report.
_NOT_COMPARED = ("timing_s/", "timing_per_token_ms/", "perf/", "balance/", "global_seqlen/", "global_workload/",
                 "plan/", "step")
# The rollout-vs-actor mismatch metrics (vLLM's log-probs against the trainer's, ~1e-5 apart): the two
# runs' values differ at the level of that noise; reported apart, as absolute differences.
_MISMATCH = ("training/rollout_", "rollout_corr/")


# This comparison's changes to the README run (readme_run.overrides); later overrides win.
CHANGES = ["actor_rollout_ref.actor.use_prefix_grouper=False", "trainer.val_before_train=False",
           "actor_rollout_ref.actor.optim.lr=1e-5", "actor_rollout_ref.actor.use_kl_loss=True",
           "actor_rollout_ref.rollout.calculate_log_probs=True"]


def compare(plain: list[dict], piped: list[dict]) -> dict:
    """Per compared metric: the largest |difference| and relative difference over the steps."""
    out = {}
    for a, b in zip(plain, piped):
        for key, value in a.items():
            if key.startswith(_NOT_COMPARED) or key not in b or not isinstance(value, (int, float)):
                continue
            diff = abs(b[key] - value)
            if not math.isfinite(diff):
                continue
            rel = diff / max(abs(value), 1e-12) if diff else 0.0
            worst = out.setdefault(key, {"abs": 0.0, "rel": 0.0})
            worst["abs"], worst["rel"] = max(worst["abs"], diff), max(worst["rel"], rel)
    return dict(sorted(out.items()))


SHOWN = ["balance/actor_plan/num_micro_batches", "balance/actor_plan/pp_slot_tokens", "balance/actor_plan/pp_slot_fill",
         "critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm",
         "actor/ppo_kl", "actor/entropy", "actor/pg_clipfrac", "training/rollout_actor_log_prob_diff/max",
         "perf/pp_bubble_fraction", "perf/pp_bubble_fraction_predicted", "timing_s/update_actor", "timing_s/step"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir")
    p.add_argument("--data-dir")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-dir", default=os.path.join(readme_run.ROOT, "outputs", "pp_real_model"))
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.test_freq = -1  # no validation
    readme_run.resolve_task(args)
    results = {"machine": cpu_info(), "steps": args.steps, "seed": args.seed, "runs": {}}
    for name, extra in (("pp1", []), ("pp2", PP2)):
        rows, wall, code = readme_run.run_trainer(args, args.seed, [*CHANGES, *extra],
                                                  os.path.join(args.log_dir, f"{name}.log"))
        steps = readme_run.step_rows(rows)
        results["runs"][name] = {"exit_code": code, "wall_s": wall,
                                 "steps": [{k: r.get(k) for k in ["step", *SHOWN]} for r in steps], "all": steps}
        print(json.dumps({"run": name, "exit_code": code, "wall_s": round(wall, 1), "steps": len(steps)}), flush=True)
        if code != 0:
            break
    runs = results["runs"]
    if all(r["exit_code"] == 0 for r in runs.values()) and len(runs) == 2:
        diffs = compare(runs["pp1"]["all"], runs["pp2"]["all"])
        results["max_diff"] = diffs
        training = {k: d for k, d in diffs.items() if not k.startswith(_MISMATCH)}
        results["max_rel_diff"] = max((d["rel"] for d in training.values()), default=0.0)
        results["max_rel_diff_metric"] = max(training, key=lambda k: training[k]["rel"]) if training else None
        results["mismatch_metrics_max_abs_diff"] = max((d["abs"] for k, d in diffs.items() if k.startswith(_MISMATCH)),
                                                       default=0.0)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if all(r["exit_code"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
