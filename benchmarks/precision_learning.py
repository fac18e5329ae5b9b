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

import readme_run

LR = 1e-5  # the README run's
VARIANTS = {
    "fp32": [],
    "bf16": ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
             "actor_rollout_ref.rollout.dtype=bfloat16"],
    "bf16_train": ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"],
}


if __name__ == "__main__":
    readme_run.variants_main(__doc__, "precision_learning", VARIANTS, LR, "fp32")
