"""Tool-calling rollout: request-level async against turn-by-turn batched, on the same engine and work.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/agent_bench.py --json out.json

Work. `--conversations` conversations (default 32), each making K tool calls (K drawn per
conversation from `--min-calls`..`--max-calls`, default 4..8), i.e. K + 1 model turns. Each turn samples a fixed number of
tokens with `ignore_eos` (so both modes generate exactly the same tokens): most turns are short
(`--short` range), a fraction `--long-frac` are long (`--long` range), the long tail that a batch
barrier waits for. Each tool call goes through the real `ToolExecutor` to a tool that waits
`--tool-latency-s` (default 0.2 s) and returns a fixed text, whose `--tool-tokens` ids are appended
before the next turn. Lengths and call counts come from `--seed`, identical for both modes.

Modes, on one engine (vLLM by default, `--backend hf` for transformers) and the same `AsyncEngine`:
  * `async`: every conversation is its own coroutine (what the rollout runs): its next turn
    is submitted as soon as its tool answers, while other conversations are generating;
  * `batched`: turn by turn, as a batched rollout would play the same conversations: all turn-t
    requests are submitted together (one batch, each row stopping at its own length), the step
    waits for the whole batch, then runs every tool call of the turn concurrently and waits for all
    of them, then turn t + 1.
  * `critical` (a bound, not a mode): the one conversation async mode must wait for, alone on the
    engine (the one whose own turns and tool calls take longest when run by itself). No schedule
    can finish the work sooner than its turns one after another, so `critical_s / batched_s` is the
    lowest ratio any request-level scheduler could reach on this work on this machine.
`--trace-steps` (vLLM) records every engine step's seconds and the rows and tokens scheduled into it,
each run's totals (`runs[].trace`) and a least-squares fit over all steps of the step-cost model
seconds = fixed + per prefill token x (tokens - rows) + per row x rows (`step_cost_model`): what a step
costs on this machine, from which a bound on the work follows (docs/benchmarks.md).
Every run (warm-up and bound included) starts from an empty prefix cache, so each mode prefills the same
tokens whatever ran before it on the engine. All run `--repeats` times, interleaved (batched, async, critical, critical, async, batched, ...) after
one warm-up of each; the result is the median wall time per mode and the ratio async / batched
(target: async <= 0.5 x batched on the 2-core box), beside the bound. Token and tool-call totals are
reported to show that async and batched do the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def make_work(args) -> list[dict]:
    """Per conversation: prompt ids and the token count of each of its turns (K calls -> K + 1 turns)."""
    rng = np.random.default_rng(args.seed)
    work = []
    for _ in range(args.conversations):
        calls = int(rng.integers(args.min_calls, args.max_calls + 1))
        lengths = []
        for _ in range(calls + 1):
            lo, hi = args.long if rng.random() < args.long_frac else args.short
            lengths.append(int(rng.integers(lo, hi + 1)))
        prompt = rng.integers(10, 400, int(rng.integers(16, 33))).tolist()
        work.append({"prompt": prompt, "turns": lengths})
    return work


def build_engine(args, work: list[dict]):
    from ballast.models import build_tiny_model
    from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend

    model = args.model_dir or str(build_tiny_model(os.path.join(args.cache, "agent_bench_tiny"),
                                                   preset=args.preset, seed=0))
    sampling = SamplingConfig(max_response_length=args.long[1], seed=args.seed, ignore_eos=True)
    # the longest conversation of this work (a bound from the ranges alone can pass the model's 2048 positions)
    sizes = [len(w["prompt"]) + sum(w["turns"]) + (len(w["turns"]) - 1) * args.tool_tokens for w in work]
    cfg = RolloutConfig(model_path=model, backend=args.backend, device="cpu", max_model_len=max(sizes) + 8,
                        kv_cache_memory_bytes=kv_cache_bytes(model, sum(sizes)),
                        max_num_seqs=max(64, args.conversations), dtype=args.dtype,
                        block_size=32 if args.backend == "vllm" else None, sampling=sampling)
    backend = build_backend(cfg)

    def new_core():
        # Every run starts from an empty prefix cache: blocks a previous run left behind (the same
        # conversations, the same tokens) would turn this run's prefill into cache hits, so a run's cost
        # would depend on what ran before it.
        if args.backend == "vllm" and backend.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache between runs")
        core = backend.core(sampling)
        return new_core.trace.wrap(core) if new_core.trace is not None else core

    new_core.trace = StepTrace(backend) if args.trace_steps and args.backend == "vllm" else None
    return new_core


def kv_cache_bytes(model_dir: str, tokens: int) -> int:
    """A KV cache that holds every conversation whole (async mode keeps them all live), at least 256 MiB."""
    from ballast.trainer.config import ModelInfo

    m = ModelInfo.from_dir(model_dir, key="--model-dir")
    per_token = 2 * m.num_hidden_layers * m.num_key_value_heads * m.resolved_head_dim * 4  # K and V, float32 (an upper bound)
    return max(256 << 20, int(1.5 * tokens * per_token))


def make_tools(latency_s: float):
    from ballast.tools import Tool, ToolCall, ToolExecutor

    class Waits(Tool):
        default_schema = {"type": "function", "function": {"name": "lookup", "description": "a slow lookup",
                                                           "parameters": {"type": "object", "properties": {}}}}

        async def execute(self, instance_id, parameters, **kwargs):
            await asyncio.sleep(latency_s)
            return "result: 42"

    executor = ToolExecutor({"lookup": Waits()}, max_parallel_calls=1, timeout_s=30, max_concurrency=1024)
    return executor, ToolCall("lookup", {})


async def _async_mode(engine, work, executor, call, tool_ids):
    from ballast.workers.rollout.async_engine import TurnRequest

    async def conversation(i, item):
        ids = list(item["prompt"])
        for t, n in enumerate(item["turns"]):
            out = await engine.generate(TurnRequest(ids, n, seed=1000 * i + t))
            ids += out.token_ids
            if t < len(item["turns"]) - 1:
                await executor.run_turn([call])
                ids += tool_ids
        return len(ids) - len(item["prompt"])

    return await asyncio.gather(*(conversation(i, w) for i, w in enumerate(work)))


async def _batched_mode(engine, work, executor, call, tool_ids):
    from ballast.workers.rollout.async_engine import TurnRequest

    seqs = [list(w["prompt"]) for w in work]
    for t in range(max(len(w["turns"]) for w in work)):
        active = [i for i, w in enumerate(work) if t < len(w["turns"])]
        outs = await asyncio.gather(*(engine.generate(TurnRequest(seqs[i], work[i]["turns"][t], seed=1000 * i + t))
                                      for i in active))
        for i, out in zip(active, outs):
            seqs[i] += out.token_ids
        calling = [i for i in active if t < len(work[i]["turns"]) - 1]
        await asyncio.gather(*(executor.run_turn([call]) for _ in calling))
        for i in calling:
            seqs[i] += tool_ids
    return [len(s) - len(w["prompt"]) for s, w in zip(seqs, work)]


def critical_conversation(new_core, work, executor, call, tool_ids, latency_s: float, candidates: int) -> int:
    """The index of the conversation that takes longest alone on the engine (each candidate timed once).

    With `candidates` > 0 only that many are timed: those a cost estimate ranks highest (sampled tokens at
    the per-token time of the conversation with the most tokens, alone, plus its tool calls' latency). On a
    real model one conversation alone takes a minute, and the estimate's ranking is what timing would give
    wherever decode steps cost about the same whatever the context, as they do at these lengths.
    """
    def alone(i: int) -> float:
        return run_mode("async", new_core, [work[i]], executor, call, tool_ids)["seconds"]

    order, times = list(range(len(work))), {}
    if 0 < candidates < len(work):
        tokens = [sum(w["turns"]) for w in work]
        probe = int(np.argmax(tokens))
        times[probe] = alone(probe)  # a candidate too, if the estimate ranks it there: not timed twice
        per_token = (times[probe] - latency_s * (len(work[probe]["turns"]) - 1)) / tokens[probe]
        est = [tokens[i] * per_token + latency_s * (len(w["turns"]) - 1) for i, w in enumerate(work)]
        order = sorted(order, key=lambda i: -est[i])[:candidates]
        times = {i: t for i, t in times.items() if i in order}
    times.update({i: alone(i) for i in order if i not in times})
    return max(times, key=times.get)


class StepTrace:
    """Every engine step of a run (vLLM only): its seconds and the rows and tokens the scheduler put
    into it, through a hook on this engine's scheduler instance (bench instrumentation, nothing global).
    `fit` gives the step-cost model seconds = fixed + per_prefill_token x (tokens - rows) + per_row x rows
    over the steps traced: what a step costs on this machine, from which a bound on the work follows."""

    def __init__(self, backend):
        scheduler = backend.llm.llm_engine.engine_core.engine_core.scheduler
        schedule, self._last, self.steps = scheduler.schedule, (0, 0), []

        def hooked(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self._last = (len(out.num_scheduled_tokens), out.total_num_scheduled_tokens)
            return out

        scheduler.schedule = hooked

    def wrap(self, core):
        step = core.step

        def timed():
            start = time.perf_counter()
            out = step()
            self.steps.append((time.perf_counter() - start, *self._last))
            return out

        core.step = timed
        return core

    @staticmethod
    def fit(steps: list) -> dict:
        t = np.asarray(steps, dtype=float)
        seconds, rows, tokens = t[:, 0], t[:, 1], t[:, 2]
        design = np.stack([np.ones_like(rows), tokens - rows, rows], axis=1)
        fixed, per_token, per_row = np.linalg.lstsq(design, seconds, rcond=None)[0]
        return {"fixed_s": float(fixed), "per_prefill_token_s": float(per_token), "per_row_s": float(per_row),
                "steps": len(t)}


def run_mode(mode: str, new_core, work, executor, call, tool_ids) -> dict:
    from ballast.workers.rollout.async_engine import AsyncEngine

    play = _batched_mode if mode == "batched" else _async_mode

    async def main():
        async with AsyncEngine(new_core()) as engine:
            start = time.perf_counter()
            lengths = await play(engine, work, executor, call, tool_ids)
            return time.perf_counter() - start, lengths, engine.steps

    trace = new_core.trace
    first = len(trace.steps) if trace is not None else 0
    seconds, lengths, steps = asyncio.run(main())
    out = {"mode": mode, "seconds": seconds, "response_tokens": int(sum(lengths)), "engine_steps": steps}
    if trace is not None:
        mine = trace.steps[first:]
        out["trace"] = {"step_seconds": sum(s for s, _, _ in mine), "rows": sum(r for _, r, _ in mine),
                        "tokens": sum(k for _, _, k in mine)}
    return out


def main() -> None:
    from machine import cpu_info  # this directory is first on sys.path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model-dir", help="a local HF model directory instead of the tiny model (e.g. SmolLM2)")
    p.add_argument("--dtype", default="auto", help="the rollout engine's dtype (auto: float32 on CPU), both modes")
    p.add_argument("--warmup-conversations", type=int, default=0,
                   help="warm each mode up on the first N conversations only (0: the whole work)")
    p.add_argument("--critical-candidates", type=int, default=0,
                   help="time only the N conversations a cost estimate ranks longest for the bound (0: all)")
    p.add_argument("--trace-steps", action="store_true",
                   help="vLLM: record every engine step's seconds, rows and tokens and fit the step-cost model")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--min-calls", type=int, default=4)
    p.add_argument("--max-calls", type=int, default=8)
    p.add_argument("--short", type=int, nargs=2, default=[8, 32])
    p.add_argument("--long", type=int, nargs=2, default=[160, 256])
    p.add_argument("--long-frac", type=float, default=0.05)
    p.add_argument("--tool-latency-s", type=float, default=0.2)
    p.add_argument("--tool-tokens", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "ballast_agent_bench"))
    args = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    work = make_work(args)
    new_core = build_engine(args, work)
    executor, call = make_tools(args.tool_latency_s)
    tool_ids = list(range(50, 50 + args.tool_tokens))
    runs = {"async": [], "batched": [], "critical": []}
    warm = work[:args.warmup_conversations] if args.warmup_conversations > 0 else work
    for mode in ("batched", "async"):  # warm-up (first-shape compiles), not counted
        run_mode(mode, new_core, warm, executor, call, tool_ids)
    critical = critical_conversation(new_core, work, executor, call, tool_ids, args.tool_latency_s,
                                     args.critical_candidates)
    works = {"async": work, "batched": work, "critical": [work[critical]]}
    for rep in range(args.repeats):
        for mode in (("batched", "async", "critical") if rep % 2 == 0 else ("critical", "async", "batched")):
            r = run_mode(mode, new_core, works[mode], executor, call, tool_ids)
            runs[mode].append(r)
            print(f"rep {rep} {mode}: {r['seconds']:.3f} s, {r['response_tokens']} response tokens, "
                  f"{r['engine_steps']} engine steps", flush=True)
    med = {m: statistics.median(r["seconds"] for r in rs) for m, rs in runs.items()}
    calls = sum(len(w["turns"]) - 1 for w in work)
    sampled = sum(sum(w["turns"]) for w in work)
    result = {
        "machine": {"platform": platform.platform(), "cpu": cpu_info(), "cpus": os.cpu_count(),
                    "load_avg_end": os.getloadavg()},
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "work": {"conversations": len(work), "tool_calls": calls, "sampled_tokens": sampled,
                 "inserted_tokens": calls * args.tool_tokens, "turns": calls + len(work)},
        "critical_conversation": {"index": critical, "turn_tokens": work[critical]["turns"],
                                  "tool_calls": len(work[critical]["turns"]) - 1},
        "async_s": med["async"], "batched_s": med["batched"], "critical_s": med["critical"],
        "ratio_async_vs_batched": med["async"] / med["batched"],
        "ratio_bound_critical_vs_batched": med["critical"] / med["batched"],
        "paired_ratios": [a["seconds"] / b["seconds"] for a, b in zip(runs["async"], runs["batched"])],
        "runs": runs,
    }
    if new_core.trace is not None:  # the timed runs' steps (warm-up and bound search included: same engine)
        result["step_cost_model"] = StepTrace.fit(new_core.trace.steps)
    for mode in ("async", "batched"):  # the same work in both modes
        assert all(r["response_tokens"] == sampled + calls * args.tool_tokens for r in runs[mode]), mode
    print(json.dumps({k: result[k] for k in ("work", "critical_conversation", "async_s", "batched_s", "critical_s",
                                             "ratio_async_vs_batched", "ratio_bound_critical_vs_batched",
                                             "paired_ratios", "step_cost_model") if k in result}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
