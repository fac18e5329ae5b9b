"""FSDP2 on CPU/gloo: gradient reduction once per mini-batch vs after every micro-batch, and
reshard-after-forward on vs off, measured on the engine alone (no Ray, no vLLM).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/grad_sync_bench.py --json out.json

Two gloo ranks, one thread each, the `small` tiny Qwen2 (~4 M parameters); each rank holds
`--samples` sequences with log-normal lengths cut into token-budget micro-batches (`--budget`). One
update = `forward_backward_batch` + `optimizer_step`. The four configurations run interleaved (one
update of each in turn, `--repeats` rounds after a warm-up round) so that load from other jobs hits
them alike; reported: median seconds per update and the ratio to the engine's default
(reduce once per mini-batch, reshard after forward).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def _rank(rank: int, world: int, args, out_path: str) -> None:
    import torch

    from ballast.engine import EngineConfig, MicroBatchSpec, OptimConfig, TrainEngine, agg_loss
    from testkit.engine import make_rl_batch
    from ballast.models import tiny_model_dir
    from engine_bench import lognormal_lengths

    def loss_fn(outputs, micro, norm):
        return agg_loss(-micro["advantages"] * outputs["log_probs"], micro["response_mask"], "token-mean", norm), {}

    prompts, responses = lognormal_lengths(args.samples, 48, 0.9, 512, seed=rank)
    data = make_rl_batch(prompts, responses, vocab_size=500, seed=rank)
    spec = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=args.budget)
    engines = {}
    for reshard in (True, False):
        cfg = EngineConfig(model_path=str(tiny_model_dir("small")), use_remove_padding=True, device="cpu",
                           reshard_after_forward=reshard, optim=OptimConfig(lr=1e-5))
        engines[reshard] = TrainEngine(cfg)
    configs = [(sync_once, reshard) for reshard in (True, False) for sync_once in (True, False)]
    times = {c: [] for c in configs}
    micro = 0
    deferring = {reshard: engine.data_parallel for reshard, engine in engines.items()}
    for round_ in range(args.repeats + 1):
        for sync_once, reshard in configs:
            engine = engines[reshard]
            # not sync_once: FSDP2's default, the GPU setting (reduce after every backward)
            engine.data_parallel = dataclasses.replace(deferring[reshard], defer_reduction=sync_once)
            start = time.perf_counter()
            metrics = engine.forward_backward_batch(data, loss_fn, engine.plan_micro_batches(data, spec))
            engine.optimizer_step()
            elapsed = time.perf_counter() - start
            micro = int(metrics["num_micro_batches"])
            if round_ > 0:
                times[(sync_once, reshard)].append(elapsed)
    if rank == 0:
        base = statistics.median(times[(True, True)])
        result = {"micro_batches_per_update": micro, "samples_per_rank": args.samples, "budget": args.budget,
                  "configs": [{"grad_sync": "once_per_mini_batch" if s else "every_micro_batch",
                               "reshard_after_forward": r, "s_per_update": statistics.median(t),
                               "ratio_to_default": statistics.median(t) / base, "all_s": t}
                              for (s, r), t in times.items()]}
        with open(out_path, "w") as f:
            json.dump(result, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from testkit.engine import spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spawn_ranks(_rank, 2, args=(args, out), timeout_s=1800, start_method="spawn")
        with open(out) as f:
            result = json.load(f)
    for c in result["configs"]:
        print(f"{c['grad_sync']:>20} reshard_after_forward={c['reshard_after_forward']!s:5} "
              f"{c['s_per_update']:.3f} s/update  x{c['ratio_to_default']:.3f}")
    print(f"micro-batches per update: {result['micro_batches_per_update']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
