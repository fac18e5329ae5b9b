"""Sandboxed executions per second, latency, and the isolation's cost per call against the unisolated
child interpreter, at several concurrency levels.

Two programs: `trivial` (`pass`) and `test_case` (a realistic code-reward test: a short solution, the
fn_name harness that reads JSON arguments from stdin, calls it and prints the JSON result, as
`ballast.data.code_reward` runs each hidden test). Two modes on the same `Sandbox` code path:
`isolated` (bubblewrap + seccomp + process cap, what every execution gets) and `unisolated`
(`unsafe=True`: the same runner in a plain `python -I -S` child with an empty environment, its own
session, a temporary directory and the rlimits, which is what the Python tool ran before the sandbox).
For each concurrency level, each repeat runs `calls` executions of one mode with that many in flight
(one asyncio loop), modes alternating within the repeat so drift on a shared box hits both alike.
Reported per (program, concurrency, mode): executions/s, p50/p99 latency of one call; and the cost
ratio isolated/unisolated of p50 latency and of throughput, paired by repeat.

    python benchmarks/sandbox_bench.py [--json [PATH]] [--calls 40] [--repeats 3] [--concurrency 1 2 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from machine import cpu_info

from ballast.data.code_reward import _CALL_HARNESS
from ballast.tools.sandbox import Sandbox, SandboxLimits

PROGRAMS = {
    "trivial": ("pass", ""),
    "test_case": ("def f(x):\n    return sorted(x, key=lambda v: (-v % 7, v))[:3]\n" + _CALL_HARNESS.format(name="f"),
                  "[5, 3, 9, 14, 2, 8, 1]\n"),
}


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def burst(sandbox: Sandbox, program: str, stdin: str, calls: int, concurrency: int):
    """(wall seconds, per-call latencies) of `calls` executions with `concurrency` in flight."""
    slots = asyncio.Semaphore(concurrency)
    latencies = []

    async def one():
        async with slots:
            start = time.perf_counter()
            result = await sandbox.run(program, stdin)
            latencies.append(time.perf_counter() - start)
            if not result.ok:
                raise RuntimeError(f"the benchmark program failed: {result}")

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(calls)))
    return time.perf_counter() - start, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", nargs="?", const="-", default=None, help="print JSON (to PATH if given)")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    limits = SandboxLimits(timeout_s=30)
    sandboxes = {"unisolated": Sandbox(limits, owner="sandbox_bench", unsafe=True),
                 "isolated": Sandbox(limits, owner="sandbox_bench")}
    rows = []
    for name, (program, stdin) in PROGRAMS.items():
        for concurrency in args.concurrency:
            per_mode = {mode: {"throughput": [], "p50": [], "latencies": []} for mode in sandboxes}
            for repeat in range(args.repeats):
                order = list(sandboxes) if repeat % 2 == 0 else list(reversed(sandboxes))
                for mode in order:
                    asyncio.run(burst(sandboxes[mode], program, stdin, 2, concurrency))  # warm the page cache
                    wall, lat = asyncio.run(burst(sandboxes[mode], program, stdin, args.calls, concurrency))
                    per_mode[mode]["throughput"].append(args.calls / wall)
                    per_mode[mode]["p50"].append(statistics.median(lat))
                    per_mode[mode]["latencies"] += lat
            row = {"program": name, "concurrency": concurrency}
            for mode, got in per_mode.items():
                row[mode] = {"executions_per_s": statistics.median(got["throughput"]),
                             "p50_ms": 1e3 * statistics.median(got["latencies"]),
                             "p99_ms": 1e3 * percentile(got["latencies"], 0.99)}
            iso, raw = per_mode["isolated"], per_mode["unisolated"]
            row["cost_p50_latency"] = statistics.median(a / b for a, b in zip(iso["p50"], raw["p50"]))
            row["cost_throughput"] = statistics.median(b / a for a, b in zip(iso["throughput"], raw["throughput"]))
            rows.append(row)
            if args.json is None:
                print(f"{name:9s} c={concurrency}: isolated {row['isolated']['executions_per_s']:6.1f}/s "
                      f"p50 {row['isolated']['p50_ms']:6.1f} ms p99 {row['isolated']['p99_ms']:6.1f} ms | "
                      f"unisolated {row['unisolated']['executions_per_s']:6.1f}/s p50 {row['unisolated']['p50_ms']:6.1f} ms"
                      f" | cost x{row['cost_p50_latency']:.2f} (latency) x{row['cost_throughput']:.2f} (throughput)")
    iso = sandboxes["isolated"].isolation
    out = {"benchmark": "sandbox_bench", "date": time.strftime("%Y-%m-%d"), "machine": cpu_info(),
           "process_cap": iso.process_cap, "calls": args.calls, "repeats": args.repeats, "results": rows}
    if args.json is not None:
        text = json.dumps(out, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
