"""Does running each prompt once (`actor_rollout_ref.actor.use_prefix_grouper`) learn as running every
row does? The README's real-model run (GRPO on SmolLM2-135M-Instruct's arithmetic task,
examples/run_grpo_smollm2_cpu.sh, which shares prompts), same steps, same seeds, in two variants:

* `shared`: the run as it is;
* `rows`: the same with `use_prefix_grouper=False` (every row runs its own copy of its prompt).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/shared_prompts_learning.py --steps 10 --seeds 1 --json out.json

The gradients are the same to float rounding (tests/distributed/test_shared_prompts_engine.py), so
the curves can differ only where rounding changes which samples vLLM draws. Per variant and seed:
the held-out greedy score curve, the mean train score of the last half of the steps, s/step and the
update and generation seconds; then `shared`'s final held-out score minus `rows'`. `--resume` keeps
the runs `--json` already holds.
"""

from __future__ import annotations

import readme_run

LR = 1e-5  # the README run's
VARIANTS = {"shared": [], "rows": ["actor_rollout_ref.actor.use_prefix_grouper=False"]}


if __name__ == "__main__":
    readme_run.variants_main(__doc__, "shared_prompts_learning", VARIANTS, LR, "rows")
