"""Pipeline parallelism on this CPU: the bubble against its formula, the micro-batch order, the
padding of fixed slots, and pp=2 against dp=2.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pp_bench.py --json out.json [--repeats 5] [--quick]

Every measured case runs two gloo processes (one thread each) of `PipelineEngine` (pp=2, dp=1) on a
random Qwen2 of 8 layers, hidden 256, vocab 512 (`small`), one mini-batch per step:

* `bubble`: on the same model with 16 layers (`deep`: with v=2 each rank's two chunks hold four layers,
  so the head and loss on the last chunk and the extra sends of interleaving, which the formula leaves
  out, weigh on it no more than on the chunks of a real model), equal micro-batches (each four sequences
  of 250 tokens in a 1024-token slot), m of them,
  for 1F1B and interleaved 1F1B (v=2) at m = 2, 4, 8, and zero bubble (v=2): the engine's
  `perf/pp_bubble_fraction` (the mean over the two ranks of the time a rank computed nothing, over
  the step's wall time, from the stages' own timelines), median over the repeats, against the
  formula (p-1)/(vm+p-1) (none for zero bubble) and the cost model's prediction; the first step of
  each count (which builds its stages and schedule) against the median one;
* `order`: GRPO-like batches (64 samples, log-normal lengths, median 150, up to 1000 tokens, budget
  1024): the same micro-batches in the planner's order, verl's pyramid (by verl's workload
  24576 L + L^2) and a random order, modelled (the cost model's step) and measured (median step
  wall time; the three orders alternate within every repeat, so the box's drift hits all alike);
* `pp_vs_dp`: the same batch as one pipeline (pp=2) and as two data-parallel whole replicas (dp=2,
  DDP, the CPU default), forward + backward + optimizer step, median step time, alternating;

and, planned only (no run):

* `padding`: SmolLM2-135M's cost model (30 layers, pp=2) on GRPO batches shaped like the real-model
  runs (8 prompts x 8 samples per DP rank, prompts 40-80 tokens, log-normal responses up to 512):
  padding waste (1 - real tokens / slot tokens) of the plan (slots fitted to its micro-batches, at the
  count it chose), and of slots of the whole budget at the smallest count the schedule runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from machine import cpu_info  # noqa: E402

SMALL = dict(vocab_size=512, hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=512)
DEEP = dict(SMALL, num_layers=16)
SLOT = 1024


def _loss(outputs, micro, norm):
    from ballast.engine.losses import agg_loss

    return agg_loss(-micro["advantages"] * outputs["log_probs"], micro["response_mask"], "token-mean", norm), {}


def _grpo_lengths(rng, n, median=150, cap=1000):
    return np.clip(np.round(rng.lognormal(np.log(median), 0.7, n)), 8, cap).astype(int)


def _batch(lengths, seed):
    from testkit.engine import make_rl_batch

    prompts = np.maximum(1, np.round(lengths * 0.3)).astype(int)
    return make_rl_batch(prompts.tolist(), (lengths - prompts).tolist(), vocab_size=SMALL["vocab_size"], seed=seed)


def _plan(micro_batches, slot):
    from ballast.balance import MiniBatchPlan

    return MiniBatchPlan((tuple(np.asarray(mb, dtype=np.int64) for mb in micro_batches),), token_budget=slot,
                         slot_tokens=slot)


def _engine(model_dir, schedule, v, lr=1e-4):
    from ballast.engine import EngineConfig, PipelineEngine
    from ballast.engine.config import OptimConfig, PipelineSpec

    return PipelineEngine(EngineConfig(model_path=model_dir, pipeline=PipelineSpec(2, v, schedule),
                                       optim=OptimConfig(lr=lr)))


def _step(engine, data, plan):
    start = time.perf_counter()
    metrics = engine.forward_backward_batch(data, _loss, plan)
    engine.zero_grad()
    return time.perf_counter() - start, metrics


def _bubble_worker(rank, world, model_dir, out, repeats, counts):
    rows = []
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)):
        engine = _engine(model_dir, schedule, v)
        for m in counts:
            data = _batch(np.full(4 * m, 250), seed=m)
            plan = _plan([np.arange(4 * j, 4 * j + 4) for j in range(m)], SLOT)
            first_s = _step(engine, data, plan)[0]  # warm-up: builds this count's stages and schedule
            measured, predicted, wall = [], [], []
            for _ in range(repeats):
                seconds, metrics = _step(engine, data, plan)
                measured.append(metrics["perf/pp_bubble_fraction"])
                predicted.append(metrics["perf/pp_bubble_fraction_predicted"])
                wall.append(seconds)
            formula = None if schedule == "zero_bubble" else (2 - 1) / (v * m + 2 - 1)
            rows.append(dict(schedule=schedule, v=v, m=m, measured=statistics.median(measured),
                             measured_all=measured, predicted=statistics.median(predicted), formula=formula,
                             step_s=statistics.median(wall), first_step_s=first_s))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def _orders(engine, lengths, rng):
    """(micro-batches, {name: order}, slot) for one GRPO batch: the planner's order, verl's pyramid, a
    random one, and the plan's slot."""
    from ballast.balance import MicroBatchPolicy, plan_phase
    from ballast.balance.pipeline_cost import pyramid_order
    from ballast.balance.workload import workload_costs

    plan = plan_phase(lengths, 1, MicroBatchPolicy("dynamic", token_budget=SLOT, pipeline=engine.cost_model),
                      workload=engine.workload)
    micro = list(plan.mini_batches[0].for_rank(0))
    verl = [float(workload_costs(lengths[mb], "verl").sum()) for mb in micro]
    return micro, {"planner": np.arange(len(micro)), "pyramid": pyramid_order(verl),
                   "random": rng.permutation(len(micro))}, plan.mini_batches[0].slot_tokens


def _order_worker(rank, world, model_dir, out, repeats, batches):
    from ballast.balance.pipeline_cost import MicroBatchWork

    engine = _engine(model_dir, "1f1b", 1)
    rows = []
    for seed in range(batches):
        rng = np.random.default_rng(100 + seed)
        lengths = _grpo_lengths(rng, 64)
        data = _batch(lengths, seed)
        micro, orders, slot = _orders(engine, lengths, rng)
        works = [MicroBatchWork.of(lengths[mb]) for mb in micro]
        plans = {name: _plan([micro[j] for j in order], slot) for name, order in orders.items()}
        _step(engine, data, plans["planner"])
        seconds = {name: [] for name in plans}
        names = list(plans)
        for r in range(repeats):
            for name in names[r % 3:] + names[:r % 3]:
                seconds[name].append(_step(engine, data, plans[name])[0])
        rows.append(dict(seed=seed, num_micro_batches=len(micro), slot_tokens=slot,
                         modelled={n: engine.cost_model.simulate(works, o).step_time for n, o in orders.items()},
                         modelled_bubble={n: engine.cost_model.simulate(works, o).bubble_fraction
                                          for n, o in orders.items()},
                         measured_s={n: statistics.median(s) for n, s in seconds.items()}, measured_all=seconds))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def _pp_vs_dp_worker(rank, world, model_dir, out, repeats):
    import torch

    from ballast.engine import EngineConfig, MicroBatchSpec, TrainEngine
    from ballast.engine.config import OptimConfig
    from ballast.engine.dist import build_parallel_state

    rng = np.random.default_rng(7)
    lengths = _grpo_lengths(rng, 64)
    data = _batch(lengths, 1)
    pipeline = _engine(model_dir, "1f1b", 1)
    micro, _, slot = _orders(pipeline, lengths, rng)
    pp_plan = _plan(micro, slot)
    replicas = TrainEngine(EngineConfig(model_path=model_dir, fsdp_size=1, optim=OptimConfig(lr=1e-4)),
                           parallel=build_parallel_state(1, "cpu", 1))
    mine = data[rank * 32:(rank + 1) * 32]
    dp_plan = replicas.plan_micro_batches(mine, MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=SLOT))

    def step(engine, batch, plan):
        start = time.perf_counter()
        engine.forward_backward_batch(batch, _loss, plan)
        engine.optimizer_step()
        return time.perf_counter() - start

    step(pipeline, data, pp_plan)
    step(replicas, mine, dp_plan)
    times = {"pp2": [], "dp2": []}
    for r in range(repeats):
        pair = [("pp2", pipeline, data, pp_plan), ("dp2", replicas, mine, dp_plan)]
        for name, engine, batch, plan in (pair if r % 2 == 0 else pair[::-1]):
            times[name].append(step(engine, batch, plan))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(times={k: statistics.median(v) for k, v in times.items()}, all=times,
                           pp_micro_batches=pp_plan.num_micro_batches, dp_micro_batches=dp_plan.num_micro_batches,
                           threads=torch.get_num_threads()), f)


def padding_case(seeds: int = 20) -> dict:
    """Slot fill of SmolLM2 pipeline plans on real-model-shaped GRPO batches (planned only): the
    plan's (slots fitted to its micro-batches, at the count it chose) and, for comparison, slots of
    the whole budget at the smallest count the schedule runs."""
    from ballast.balance import FlopsModel, MicroBatchPolicy, PipelineCostModel, PipelineShape, plan_phase

    flops = FlopsModel(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                       vocab_size=49152)
    model = PipelineCostModel.from_flops(flops, PipelineShape(2))
    rows = []
    for budget in (1024, 2048):
        fills, smallest, counts, mins, slots = [], [], [], [], []
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            prompts = rng.integers(40, 81, 64)
            lengths = prompts + np.clip(np.round(rng.lognormal(np.log(120), 0.8, 64)), 1, 512).astype(int)
            plan = plan_phase(lengths, 1, MicroBatchPolicy("dynamic", token_budget=budget, pipeline=model),
                              workload=flops)
            m, m0 = plan.mini_batches[0].num_micro_batches, int(plan.metrics["plan/pp_num_micro_batches_min"])
            fills.append(plan.metrics["plan/pp_slot_fill"])
            slots.append(plan.mini_batches[0].slot_tokens)
            smallest.append(float(lengths.sum()) / (m0 * budget))
            counts.append(m)
            mins.append(m0)
        rows.append(dict(budget=budget, stage_layers=list(model.stage_layers),
                         budget_slots_waste_at_smallest_count=1 - float(np.mean(smallest)),
                         plan_waste=1 - float(np.mean(fills)), plan_waste_worst=1 - float(np.min(fills)),
                         plan_slot_tokens=float(np.mean(slots)),
                         smallest_count=float(np.mean(mins)), chosen_count=float(np.mean(counts))))
    return {"cases": rows}


def _run(worker, *args):
    from testkit.engine import spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spawn_ranks(worker, 2, args=(args[0], out, *args[1:]), timeout_s=3600)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the results as JSON to this path")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer counts and batches (a smoke run)")
    parser.add_argument("--cases", default="bubble,order,pp_vs_dp,padding")
    args = parser.parse_args(argv)
    import transformers

    from testkit.models import build_tiny_causal_lm

    transformers.utils.logging.disable_progress_bar()
    cases = set(args.cases.split(","))
    results = {"machine": cpu_info(), "model": SMALL, "slot_tokens": SLOT, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        def build(name, shape):
            return build_tiny_causal_lm(os.path.join(tmp, name), seed=0, max_positions=2048, **shape)

        model_dir = build("small", SMALL)
        if "bubble" in cases:
            results["bubble_model"] = DEEP
            results["bubble"] = _run(_bubble_worker, build("deep", DEEP), args.repeats,
                                     [2, 4] if args.quick else [2, 4, 8])
        if "order" in cases:
            results["order"] = _run(_order_worker, model_dir, args.repeats, 1 if args.quick else 3)
        if "pp_vs_dp" in cases:
            results["pp_vs_dp"] = _run(_pp_vs_dp_worker, model_dir, args.repeats)
    if "padding" in cases:
        results["padding"] = padding_case(5 if args.quick else 20)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
