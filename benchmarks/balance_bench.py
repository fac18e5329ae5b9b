"""Side-by-side benchmark of one training step's batch planning: Ballast's ``ballast.balance`` vs
verl 0.9.1's ``verl.utils.seqlen_balancing`` (installed with ``pip install --no-deps verl==0.9.1``;
only this script imports it).

Each case is a seeded length distribution (prompt + response tokens per sample), a size
(N samples, dp ranks, per-micro-batch token budget) and a model shape whose forward FLOPs are the
cost of a sample (``FlopsModel``: linear terms + causal attention; Qwen2.5-0.5B and Qwen2.5-7B
config numbers, no download). The whole step is treated as one mini-batch (the compute_log_prob
path: every rank micro-batches all of its samples). Distributions (lengths capped at the budget):
uniform 256..8192; log-normal: prompt 64..1024 + response with median 1024 and sigma 1, truncated
at max_response_length = budget/2 - 1024; bimodal: 60% ~N(700, 200), 40% ~N(7000, 2000);
long-context: log-normal with median 8192, sigma 0.6, within 1024..min(32768, budget). Added
distributions, each with its own sizes (see ``NEW_DISTRIBUTIONS``): long context with few samples
per rank (median 20k, sigma 0.8, up to the budget of 32k..128k); GRPO groups of 8 with Pareto(1.2)
response tails up to 15k; a truncation spike (30% of responses at max_response_length); all-equal
lengths; N == dp; one sample exactly at the budget among tiny ones. Seeds: 1000 + 10 * distribution
index + size index for the original grid, 2000 + ... for the added ones, 1500 + ... for ``--stress``.
The GRPO case is also run with each prompt's group kept on one rank, by every system (verl through
its prefix-grouper path). The cases themselves live in ``balance_cases.py``. ``--stress`` adds the log-normal cut only at the budget (rare samples that fill a micro-batch
alone); those cases are reported but not held to the targets.

Pipelines (all start from the per-sample lengths; ``seconds`` is their wall time):

* ours: ``plan_step(lengths, dp, budget, workload=flops, objective="lockstep")``, the plan for an
  engine with collectives in every micro-batch (FSDP2): the cheapest of its candidates by lockstep cost.
* ours_rank_total: the same with ``objective="rank_total"``, the plan for one gradient sync per
  mini-batch (DDP replicas): the lightest heaviest rank, then the lowest lockstep cost.
* ours_joint (JSON and the second table only): the previous central plan, ``balance_batch`` then
  ``plan_joint_micro_batches`` (one of plan_step's candidates).
* ours_per_rank (JSON and the second table only): the same DP partition, then the engine's own path:
  count = max over ranks of ``min_micro_batches`` (the all-reduce MAX), then every rank calls
  ``plan_dynamic_micro_batches(lengths_r, budget, count, workload=flops)`` on its own.
* verl: ``_balance_batch``'s steps: ``calculate_workload`` (24576*L + L^2) then
  ``get_seqlen_balanced_partitions(..., k=dp, equal_size=True)`` and its per-partition reorder
  (with groups kept: ``get_group_balanced_partitions``, its prefix-grouper path, and no reorder);
  then ``rearrange_micro_batches``' steps on every rank with its DP all-reduces emulated:
  count = max over ranks of min(n_r, ceil(tokens_r / budget)); every rank calls
  ``get_seqlen_balanced_partitions(workloads_r, count, equal_size=False)``; if any rank breaks the
  budget the count grows by one on all ranks (its all-reduce MIN of "within limit"); then its
  ordering (sort by workload, descending, then alternate ends). verl's functions get Python lists
  (their fastest input). Before the cases, the emulation run with one rank is checked to return
  exactly what verl's own ``rearrange_micro_batches`` returns (skip with ``--no-check-emulation``).

Metrics, computed by one function for every system (``cost`` = FLOPs of the case's model, one
sample's cost = ``FlopsModel(L)``, a micro-batch's cost = the sum over its samples):

* ``dp_imbalance``: max over ranks of the rank's total cost / mean rank total (what one gradient
  sync per mini-batch waits on, over its perfect-split bound).
* ``lockstep_over_lower_bound``: ``sum_j max_r cost(micro-batch j of rank r)`` (ranks advance
  through micro-batches together under FSDP; no fixed per-step cost) divided by the lower bound
  ``total cost / dp`` (perfect balance with free splitting; not always attainable).
* ``lockstep_over_attainable_bound``: the same over ``lockstep_lower_bounds``' second bound, which
  accounts for indivisible samples, equal sample counts and the cap (``attainable_over_lower_bound``
  per case says how far that bound is above ``total / dp``).
* ``num_micro_batches``: micro-batches per rank (checked equal on all ranks).
* ``max_micro_tokens_over_budget``: the largest micro-batch's token sum / budget.
* ``seconds`` / ``cpu_seconds``: wall / process time of the planning pipeline; the systems run
  alternately up to ``--repeat`` times each (fewer once one has used 2 s) and the fastest is kept.

Targets (``check_targets``): each of Ballast's plans is never behind verl under its own objective
(``ours`` on lockstep cost, ``ours_rank_total`` on the heaviest rank), on every case but the stress ones.

Usage: ``python benchmarks/balance_bench.py [--json PATH] [--quick] [--stress] [--repeat R]``.
Prints markdown tables and whether the targets (``check_targets``) are met; exits 0 either way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch  # verl's functions take and return torch tensors

from ballast.balance import FlopsModel, workload_costs
from ballast.balance.dp_balance import balance_batch
from ballast.balance.joint import lockstep_cost, plan_joint_micro_batches
from ballast.balance.micro_batch import min_micro_batches, plan_dynamic_micro_batches
from ballast.balance.step_plan import StepPlan, lockstep_lower_bounds, plan_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_model  # noqa: E402
from balance_cases import DISTRIBUTIONS, GROUPED, NEW_DISTRIBUTIONS, STRESS_DISTRIBUTIONS, build_cases  # noqa: E402


def evaluate(plan: list[list[np.ndarray]], tokens: np.ndarray, costs: np.ndarray, budget: int,
             bounds: tuple[float, float]) -> dict:
    """Metrics of ``plan[r][j]`` (original sample indices), the same for every system."""
    dp = len(plan)
    flat = np.concatenate([mb for rank in plan for mb in rank])
    assert np.array_equal(np.sort(flat), np.arange(len(tokens))), "a plan lost or duplicated samples"
    counts = {len(rank) for rank in plan}
    assert len(counts) == 1, f"ranks have different micro-batch counts {sorted(counts)}"
    per_rank = {sum(len(mb) for mb in rank) for rank in plan}
    assert len(per_rank) == 1, "ranks have different sample counts"
    rank_costs = np.array([sum(costs[mb].sum() for mb in rank) for rank in plan])
    lower_bound, attainable = bounds
    micro_costs = [[float(costs[mb].sum()) for mb in rank] for rank in plan]
    return {
        "dp_imbalance": float(rank_costs.max() / rank_costs.mean()),
        "lockstep_over_lower_bound": lockstep_cost(micro_costs) / lower_bound,
        "lockstep_over_attainable_bound": lockstep_cost(micro_costs) / attainable,
        "num_micro_batches": counts.pop(),
        "max_micro_tokens_over_budget": max(int(tokens[mb].sum()) for rank in plan for mb in rank) / budget,
    }


def plan_ours(tokens: np.ndarray, dp: int, budget: int, model: FlopsModel, groups=None,
              objective: str = "lockstep") -> StepPlan:
    """What the trainer's driver runs for every mini-batch, for an engine of the given objective."""
    return plan_step(tokens, dp, budget, workload=model, group_ids=groups, objective=objective)


def plan_ours_joint(tokens: np.ndarray, dp: int, budget: int, model: FlopsModel, groups=None) -> list[list[np.ndarray]]:
    """The previous central plan: workload-balanced DP partition, then joint micro-batches."""
    dp_plan = balance_batch(tokens, dp, workload=model, group_ids=groups)
    joint = plan_joint_micro_batches([tokens[p] for p in dp_plan.partitions], budget, workload=model)
    return [[part[mb] for mb in rank] for part, rank in zip(dp_plan.partitions, joint)]


def plan_ours_per_rank(tokens: np.ndarray, dp: int, budget: int, model: FlopsModel,
                       groups=None) -> list[list[np.ndarray]]:
    """The engine's own path: each rank plans alone with the count all-reduced by MAX."""
    dp_plan = balance_batch(tokens, dp, workload=model, group_ids=groups)
    per_rank = [tokens[p] for p in dp_plan.partitions]
    count = max(min_micro_batches(lengths, budget) for lengths in per_rank)  # the all-reduce MAX
    plans = [plan_dynamic_micro_batches(lengths, budget, count, workload=model) for lengths in per_rank]
    return [[part[mb] for mb in rank] for part, rank in zip(dp_plan.partitions, plans)]


def _verl_micro_batches(lens_per_rank: list[list[int]], budget: int, sb) -> list[list[list[int]]]:
    """verl's rearrange_micro_batches on every rank with the DP all-reduces emulated."""
    workloads = [sb.calculate_workload(torch.tensor(lens, dtype=torch.int64)).tolist() for lens in lens_per_rank]
    count = max(min(len(lens), sb.ceildiv(sum(lens), budget)) for lens in lens_per_rank)  # all-reduce MAX
    min_groups = min(len(lens) for lens in lens_per_rank)
    if max(max(lens) for lens in lens_per_rank) > budget:
        raise ValueError("a sample exceeds the budget")
    while True:
        if count > min_groups:
            raise ValueError("verl: more micro-batches than samples on some rank")
        parts = [sb.get_seqlen_balanced_partitions(w, count, equal_size=False) for w in workloads]
        within = all(
            sum(lens[i] for i in p) <= budget for lens, rank in zip(lens_per_rank, parts) for p in rank
        )  # all-reduce MIN of within_limit
        if within:
            break
        count += 1
    ordered = []
    for w, rank in zip(workloads, parts):
        rank.sort(key=lambda p: (sum(w[i] for i in p), p[0] if p else 0), reverse=True)
        ordered.append(rank[::2][::-1] + rank[1::2])
    return ordered


def plan_verl(tokens: np.ndarray, dp: int, budget: int, sb, groups=None) -> list[list[np.ndarray]]:
    """_balance_batch, then rearrange_micro_batches on every rank; with ``groups`` (contiguous uids)
    its prefix-grouper path: Karmarkar-Karp over the groups' summed costs, no reorder."""
    seqlen = torch.tensor(tokens, dtype=torch.int64)
    workload = sb.calculate_workload(seqlen).tolist()
    if groups is not None:
        partitions = sb.get_group_balanced_partitions(tokens.tolist(), list(groups), k_partitions=dp)
    else:
        partitions = sb.get_seqlen_balanced_partitions(workload, k_partitions=dp, equal_size=True)
        for r, part in enumerate(partitions):  # _balance_batch's per-partition reorder
            part.sort(key=lambda x: (workload[x], x))
            partitions[r] = part[::2] + part[1::2][::-1]
    token_list = tokens.tolist()
    micro = _verl_micro_batches([[token_list[i] for i in part] for part in partitions], budget, sb)
    return [[np.asarray([part[i] for i in mb], dtype=np.int64) for mb in rank] for part, rank in zip(partitions, micro)]


def check_emulation(sb) -> None:
    """With one rank and no process group, verl's own rearrange_micro_batches must agree with the emulation."""
    from tensordict import TensorDict

    rng = np.random.default_rng(1234)
    for n, budget in ((64, 8192), (200, 16384)):
        lens = np.clip(np.exp(rng.normal(np.log(1024), 1.0, n)).astype(np.int64), 16, 4096)
        mask = torch.arange(int(lens.max()))[None, :] < torch.tensor(lens)[:, None]
        batch = TensorDict({"input_ids": mask.long(), "attention_mask": mask.long()}, batch_size=[n])
        _, reference = sb.rearrange_micro_batches(batch, max_token_len=budget)
        emulated = _verl_micro_batches([lens.tolist()], budget, sb)[0]
        if [list(map(int, p)) for p in reference] != [list(map(int, p)) for p in emulated]:
            raise SystemExit(f"verl emulation differs from rearrange_micro_batches (n={n}, budget={budget})")


def run_case(name: str, tokens: np.ndarray, dp: int, budget: int, model: FlopsModel, sb, repeat: int,
             groups=None) -> dict:
    """All pipelines on one case, alternating so they see the same machine load; each is timed up
    to ``repeat`` times (no more once it has used 2 s) and its fastest run is kept."""
    costs = workload_costs(tokens, model)
    bounds = lockstep_lower_bounds(tokens, dp, budget, model)
    planners = {
        "ours": lambda: plan_ours(tokens, dp, budget, model, groups),
        "ours_rank_total": lambda: plan_ours(tokens, dp, budget, model, groups, "rank_total"),
        "verl": lambda: plan_verl(tokens, dp, budget, sb, groups),
        "ours_joint": lambda: plan_ours_joint(tokens, dp, budget, model, groups),
        "ours_per_rank": lambda: plan_ours_per_rank(tokens, dp, budget, model, groups),
    }
    times: dict[str, list[float]] = {system: [] for system in planners}
    cpu_times: dict[str, list[float]] = {system: [] for system in planners}
    plans = {}
    for _ in range(repeat):
        for system, planner in planners.items():
            if times[system] and sum(times[system]) >= 2.0:
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            plans[system] = planner()
            times[system].append(time.perf_counter() - t0)
            cpu_times[system].append(time.process_time() - c0)
    rank_total = plans["ours_rank_total"]
    out = {"name": name, "attainable_over_lower_bound": bounds[1] / bounds[0],
           "rank_total_bound_over_mean": rank_total.rank_total_lower_bound / rank_total.lower_bound,
           "ours_candidates": {"lockstep": plans["ours"].candidate, "rank_total": rank_total.candidate}}
    for system, plan in plans.items():
        micro = plan.micro_batches if isinstance(plan, StepPlan) else plan
        out[system] = {**evaluate(micro, tokens, costs, budget, bounds), "seconds": min(times[system]),
                       "cpu_seconds": min(cpu_times[system])}
    return out


# (metric key, label, format, systems shown): each objective's figure next to verl's.
TABLE_COLUMNS = [
    ("lockstep_over_lower_bound", "lockstep/LB", "{:.4f}", ("ours", "verl")),
    ("lockstep_over_attainable_bound", "lockstep/attainable", "{:.4f}", ("ours", "verl")),
    ("dp_imbalance", "rank max/mean", "{:.4f}", ("ours_rank_total", "verl")),
    ("num_micro_batches", "mb", "{:d}", ("ours", "ours_rank_total", "verl")),
    ("max_micro_tokens_over_budget", "maxtok/bud", "{:.3f}", ("ours", "ours_rank_total", "verl")),
    ("cpu_seconds", "cpu s", "{:.3f}", ("ours", "ours_rank_total", "verl")),
    ("seconds", "sec", "{:.3f}", ("ours", "ours_rank_total", "verl")),
]
SHORT = {"ours": "ls", "ours_rank_total": "rt", "verl": "verl", "ours_joint": "joint", "ours_per_rank": "per-rank"}


def print_table(cases: list[dict]) -> None:
    """ls = ours with objective lockstep, rt = ours with objective rank_total."""
    labels = [f"{label} {SHORT[system]}" for _, label, _, systems in TABLE_COLUMNS for system in systems]
    print("| case | attainable/LB | " + " | ".join(labels) + " |")
    print("|" + "---|" * (2 + len(labels)))
    for case in cases:
        cells = [case["name"], f"{case['attainable_over_lower_bound']:.4f}"]
        for key, _, fmt, systems in TABLE_COLUMNS:
            cells += [fmt.format(case[system][key]) for system in systems]
        print("| " + " | ".join(cells) + " |")


def print_objectives_table(cases: list[dict]) -> None:
    """Both figures of every plan: what each objective gives up on the other's figure."""
    systems = ("ours", "ours_rank_total", "verl")
    print("| case | " + " | ".join(f"lockstep/LB {SHORT[s]}" for s in systems) + " | "
          + " | ".join(f"rank max/mean {SHORT[s]}" for s in systems) + " | rank bound/mean |")
    print("|" + "---|" * (2 + 2 * len(systems)))
    for c in cases:
        cells = [f"{c[s]['lockstep_over_lower_bound']:.4f}" for s in systems]
        cells += [f"{c[s]['dp_imbalance']:.4f}" for s in systems]
        print(f"| {c['name']} | " + " | ".join(cells) + f" | {c['rank_total_bound_over_mean']:.4f} |")


def print_paths_table(cases: list[dict]) -> None:
    print("| case | ours (plan_step, lockstep) | previous joint | engine per-rank | verl |")
    print("|---|---|---|---|---|")
    for c in cases:
        cells = [f"{c[k]['lockstep_over_lower_bound']:.4f}" for k in ("ours", "ours_joint", "ours_per_rank", "verl")]
        print(f"| {c['name']} | " + " | ".join(cells) + " |")


def check_targets(cases: list[dict], old_cases: int) -> list[str]:
    """For both of our plans: never over the budget; no more micro-batches than verl; the N=8192,
    dp=64 plan in <= 1 s of CPU time (process time: on a shared box the wall time mostly measures
    the other jobs). Under its own objective never behind verl: the lockstep plan's lockstep cost,
    the rank-total plan's heaviest rank. Lockstep/LB <= 1.01 on the first ``old_cases`` (the
    original grid). (Equal micro-batch counts on every rank are asserted by ``evaluate``.)"""
    failures = []
    for index, c in enumerate(cases):
        verl, name = c["verl"], c["name"]
        for system in ("ours", "ours_rank_total"):
            ours = c[system]
            if ours["max_micro_tokens_over_budget"] > 1.0:
                failures.append(f"{name}: {system} over budget")
            if ours["num_micro_batches"] > verl["num_micro_batches"]:
                failures.append(f"{name}: {system} {ours['num_micro_batches']} micro-batches vs verl "
                                f"{verl['num_micro_batches']}")
            if "N=8192" in name and ours["cpu_seconds"] > 1.0:
                failures.append(f"{name}: {system} planning took {ours['cpu_seconds']:.3f} CPU s > 1 s")
        ls_ours, ls_verl = c["ours"]["lockstep_over_lower_bound"], verl["lockstep_over_lower_bound"]
        if ls_ours > ls_verl * (1 + 1e-12):
            failures.append(f"{name}: lockstep {ls_ours:.4f} behind verl {ls_verl:.4f}")
        if index < old_cases and ls_ours > 1.01:
            failures.append(f"{name}: lockstep {ls_ours:.4f} > 1.01 x the lower bound")
        rt_ours, rt_verl = c["ours_rank_total"]["dp_imbalance"], verl["dp_imbalance"]
        if rt_ours > rt_verl * (1 + 1e-12):
            failures.append(f"{name}: heaviest rank {rt_ours:.4f} x mean behind verl {rt_verl:.4f}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write {'cases': [...]} to PATH")
    parser.add_argument("--quick", action="store_true", help="only the first size of every distribution")
    parser.add_argument("--repeat", type=int, default=3,
                        help="time each pipeline up to R times (stopping once it has run 2 s), keep the fastest")
    parser.add_argument("--stress", action="store_true",
                        help="add informational cases (not held to the targets): a long tail cut only at the budget")
    parser.add_argument("--no-check-emulation", action="store_true")
    args = parser.parse_args(argv)
    import verl.utils.seqlen_balancing as sb

    if not args.no_check_emulation:
        check_emulation(sb)
    def run_all(*build_args, **build_kwargs) -> list[dict]:
        return [run_case(*case[:5], sb, args.repeat, groups=case[5])
                for case in build_cases(args.quick, *build_args, **build_kwargs)]

    cases = run_all()
    old_cases = len(cases)
    cases += run_all(NEW_DISTRIBUTIONS, seed_base=2000)
    grouped = run_all(GROUPED, seed_base=2010, groups=True)
    failures = check_targets(cases + grouped, old_cases)
    stress = []
    if args.stress:
        stress = run_all(STRESS_DISTRIBUTIONS, 500)
    result = {"machine": f"{platform.machine()} {cpu_model()}", "date": time.strftime("%Y-%m-%d"),
              "python": sys.version.split()[0], "numpy": np.__version__, "cases": cases,
              "grouped_cases": grouped, "target_failures": failures}
    if stress:
        result["stress_cases"] = stress
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print("ls = plan_step(objective='lockstep'), rt = plan_step(objective='rank_total')")
    print_table(cases)
    print("\nboth figures of every plan (rank bound/mean: StepPlan.rank_total_lower_bound / mean):")
    print_objectives_table(cases)
    print("\nlockstep cost / lower bound of every lockstep path:")
    print_paths_table(cases)
    print("\nGRPO groups kept on one rank (verl: its prefix-grouper partition, get_group_balanced_partitions):")
    print_table(grouped)
    print_objectives_table(grouped)
    if stress:
        print("\nstress cases (informational, not held to the targets):")
        print_table(stress)
    print("targets: all met" if not failures else "targets missed:\n  " + "\n  ".join(failures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
