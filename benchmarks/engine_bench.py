"""Actor-update throughput on CPU or one GPU: static padded micro-batches vs dynamic token-budget
micro-batches with remove-padding, at the same peak-memory budget.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine_bench.py --json out.json
    .venv/bin/python benchmarks/engine_bench.py --device cuda --json out.json   # scripts/gpu_smoke.sh

One mini-batch of `--samples` sequences with log-normal lengths (max/median >= 8), padded into the
engine layout (prompt width P + response width R = S). One "update" = `forward_backward_batch` +
`optimizer_step` of the `small` tiny Qwen2 (~4M parameters) on a 1-rank group (gloo on CPU; on CUDA
nccl, with the engine's CUDA defaults: bf16 compute, flash-attention varlen when installed).

* static: `use_remove_padding=False`, `micro_batch_size_per_gpu = mbs` (`--micro-batch-size`):
  every micro-batch holds exactly `mbs * S` padded token slots;
* dynamic: `use_remove_padding=True`, `max_token_len_per_gpu = mbs * S` (the same budget): every
  micro-batch holds at most that many real tokens (packed, no padding).

Both therefore present the model with at most `budget` token positions per micro-batch, the quantity
that sets activation memory. Throughput counts REAL tokens only (sum of attention_mask) per second of
wall time, the median over `--repeats` updates after one warm-up update.

Peak memory on CPU: there is no allocator high-water mark for CPU tensors, so each mode runs in its
own fresh subprocess, which records its resident set size right before the first update (model,
optimizer and data already loaded) and the process's RSS high-water mark (`ru_maxrss`) after the
last one; `*_peak_mem_mb` is the difference, i.e. the extra memory the updates needed at their peak
(activations, gradients, optimizer moments, allocator slack). On CUDA the same difference is read
from the allocator: peak allocated bytes during the updates minus the bytes allocated before them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

# The synthetic batch builder is the engine tests' (tests/testkit), kept out of the installed package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def lognormal_lengths(num_samples: int, median_tokens: int, sigma: float, max_tokens: int, seed: int):
    """(prompt_lens, response_lens): log-normal totals with max/median >= 8, prompts 10-30%."""
    rng = np.random.default_rng(seed)
    totals = np.clip(np.round(rng.lognormal(np.log(median_tokens), sigma, num_samples)), 8, max_tokens).astype(int)
    # make the long tail explicit: at least one sample at max_tokens (>= 8x the median)
    totals[int(np.argmax(totals))] = max_tokens
    if totals.max() < 8 * np.median(totals):
        raise ValueError(f"max/median = {totals.max() / np.median(totals):.1f} < 8; raise max_tokens or sigma")
    prompts = np.maximum(1, np.round(totals * rng.uniform(0.1, 0.3, num_samples))).astype(int)
    return prompts.tolist(), (totals - prompts).tolist()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def engine_setup(args, model_dir: str, seq_len: int):
    """(EngineConfig, MicroBatchSpec) of this mode on `args.device`, both modes at the same token budget."""
    from ballast.engine import EngineConfig, MicroBatchSpec, OptimConfig

    dynamic = args.mode == "dynamic"
    budget = args.micro_batch_size * seq_len
    if dynamic:
        spec = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=budget)
    else:
        spec = MicroBatchSpec(micro_batch_size_per_gpu=args.micro_batch_size)
    cfg = EngineConfig(model_path=model_dir, use_remove_padding=dynamic, device=args.device, optim=OptimConfig(lr=1e-5))
    return cfg, spec


class _PeakMemory:
    """Extra memory the updates needed at their peak, in MiB: host RSS on CPU, the allocator on CUDA."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = torch.cuda if device == "cuda" else None
        if self.cuda is not None:
            self.cuda.synchronize()
            self.cuda.reset_peak_memory_stats()
            self.before = self.cuda.memory_allocated() / 2**20
        else:
            self.before = _rss_mb()

    def sync(self) -> None:
        if self.cuda is not None:  # kernels run asynchronously: time them to their end
            self.cuda.synchronize()

    def peak_mb(self) -> float:
        if self.cuda is not None:
            return self.cuda.max_memory_allocated() / 2**20 - self.before
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - self.before


def run_mode(args) -> dict:
    """One mode in this process: engine setup, warm-up, timed updates, memory high-water mark."""
    import torch

    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    from ballast.engine import TrainEngine, agg_loss
    from testkit.engine import make_rl_batch
    from ballast.models import tiny_model_dir

    def loss_fn(outputs, micro, norm):
        loss_mat = -micro["advantages"] * outputs["log_probs"]
        return agg_loss(loss_mat, micro["response_mask"], "token-mean", norm), {}

    prompts, responses = lognormal_lengths(args.samples, args.median_tokens, args.sigma, args.max_tokens, args.seed)
    model_dir = str(tiny_model_dir(args.preset))
    data = make_rl_batch(prompts, responses, vocab_size=500, seed=args.seed)
    seq_len = data["input_ids"].shape[1]
    real_tokens = int(data["attention_mask"].sum())
    cfg, spec = engine_setup(args, model_dir, seq_len)
    engine = TrainEngine(cfg)
    num_params = sum(p.numel() for p in engine.model.parameters())
    memory = _PeakMemory(args.device)
    times, metrics = [], {}
    for i in range(args.repeats + 1):
        start = time.perf_counter()
        metrics = engine.forward_backward_batch(data, loss_fn, engine.plan_micro_batches(data, spec))
        engine.optimizer_step()
        memory.sync()
        if i > 0:  # the first update is the warm-up
            times.append(time.perf_counter() - start)
    lengths = data["attention_mask"].sum(-1).float()
    return dict(
        mode=args.mode,
        device=args.device,
        seconds_per_update=statistics.median(times),
        all_seconds=times,
        tokens_per_s=real_tokens / statistics.median(times),
        real_tokens=real_tokens,
        padded_tokens=int(data["attention_mask"].numel()),
        seq_len=seq_len,
        micro_batches=int(metrics["num_micro_batches"]),
        micro_batch_size=spec.micro_batch_size_per_gpu,
        max_token_len_per_gpu=spec.max_token_len_per_gpu,
        peak_mem_mb=memory.peak_mb(),
        num_params=num_params,
        length_median=float(lengths.median()),
        length_max=float(lengths.max()),
    )


def _gpu_name():
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the results as JSON to this path")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--median-tokens", type=int, default=48)
    parser.add_argument("--sigma", type=float, default=0.9)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument(
        "--micro-batch-size", type=int, default=4,
        help="static micro-batch size; the dynamic token budget is this times the padded length",
    )
    parser.add_argument("--preset", default="small", help="ballast.models tiny preset")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the engine runs (cuda: the engine's GPU defaults, bf16 compute)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=["static", "dynamic"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.samples % args.micro_batch_size:
        parser.error(f"--samples={args.samples} must be divisible by --micro-batch-size={args.micro_batch_size}")
    if args.mode is not None:  # worker subprocess
        print(json.dumps(run_mode(args)))
        return 0

    results = {}
    for mode in ("static", "dynamic"):
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode] + [
            a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json" and not a.endswith(".json")
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            sys.stderr.write(out.stderr)
            raise SystemExit(f"{mode} run failed")
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    s, d = results["static"], results["dynamic"]
    summary = {
        "static_tokens_per_s": s["tokens_per_s"],
        "dynamic_tokens_per_s": d["tokens_per_s"],
        "speedup": d["tokens_per_s"] / s["tokens_per_s"],
        "device": args.device,
        "static_peak_mem_mb": s["peak_mem_mb"],
        "dynamic_peak_mem_mb": d["peak_mem_mb"],
        "details": results,
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "mode")},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "loadavg_1m": os.getloadavg()[0],
            "python": platform.python_version(),
            "gpu": _gpu_name() if args.device == "cuda" else None,
        },
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "details"}, indent=2))
    print(
        f"static : {s['tokens_per_s']:.0f} real tok/s ({s['micro_batches']} micro-batches of {s['micro_batch_size']}"
        f" x {s['seq_len']} padded slots, {s['seconds_per_update']:.2f} s/update)\n"
        f"dynamic: {d['tokens_per_s']:.0f} real tok/s ({d['micro_batches']} micro-batches of <= "
        f"{d['max_token_len_per_gpu']} real tokens, {d['seconds_per_update']:.2f} s/update)\n"
        f"real tokens {s['real_tokens']} of {s['padded_tokens']} padded slots; length median "
        f"{s['length_median']:.0f}, max {s['length_max']:.0f}; params {s['num_params']:,}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
