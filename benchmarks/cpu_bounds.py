"""What one worker's core on this box allows a model's step: lower bounds from measured kernel rates.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_bounds.py --model-dir DIR --json out.json

A FLOP floor (FLOPs / the square-matmul peak) assumes every product runs at the peak and nothing else
costs anything. This script measures, on one thread and interleaved with that peak (the box's speed
drifts between minutes, so each shape is timed next to a fresh peak measurement):

* **training GEMMs**: every linear layer shape of the model (q, k, v, o, gate, up, down and the LM
  head) at a micro-batch of `--tokens` tokens (`--head-tokens` for the LM head, which the update
  projects only at response positions), in the three products of an update: forward `x @ W^T`, input
  gradient `g @ W`, weight gradient `g^T @ x`. `train_efficiency` is their FLOP-weighted rate over the
  peak: an update's matmuls cannot take less than its matmul FLOPs / (efficiency x peak).
* **decode passes**: the forward products of every layer at a decode width (rows per step), over
  weights that are all distinct (one copy per layer, as in the model), so they come from memory, not
  cache: what one decode step's matmuls cost at that width.
* **memory bandwidth**: one thread reading (sum) and copying 256 MB. A decode step reads every weight
  once; AdamW reads parameters, gradients and both moments and writes three of them (28 bytes a
  parameter in fp32), so `adamw_floor_s` = that traffic / the copy bandwidth.
* **gradient all-reduce** (`--allreduce`): two gloo processes, one thread each, all-reducing the
  model's parameter count of fp32 gradients in DDP's 25 MB buckets (`allreduce_s`).

The products are torch's (MKL / oneDNN as torch dispatches them, what the training engine runs).
vLLM's CPU path runs prepacked oneDNN GEMMs instead: in isolation up to ~1.8x faster than torch's at
8-32 rows for the smaller layers, slightly slower at one row; a whole vLLM decode step costs about
what these passes do (docs/benchmarks.md).
Prints one line per measurement, then JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_info  # noqa: E402


def rate(fn, flops: float, seconds: float) -> float:
    """FLOP/s of `fn` over about `seconds` (two warm-up calls first)."""
    fn(), fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return flops * calls / (time.perf_counter() - start)


def layer_shapes(model_dir: str) -> tuple[dict, int, int]:
    """(name -> (out, in)) of one decoder layer's linear layers and of the LM head, the layer count, and
    the parameter count AdamW updates (linear weights, embedding, an untied head, norms; biases left out)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    c = c.get("text_config", c)
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, d = c.get("num_key_value_heads") or heads, c.get("head_dim") or h // heads
    inter = c.get("intermediate_size") or 4 * h
    shapes = {"q": (heads * d, h), "k": (kv * d, h), "v": (kv * d, h), "o": (h, heads * d),
              "gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    layers, vocab = c["num_hidden_layers"], c["vocab_size"]
    embeddings = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2)
    params = layers * (sum(o * i for o, i in shapes.values()) + 2 * h) + h + embeddings
    return {**shapes, "lm_head": (vocab, h)}, layers, params


def square_peak(seconds: float, n: int = 1024) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return rate(lambda: torch.mm(a, b), 2.0 * n ** 3, seconds)


def training_gemms(shapes: dict, layers: int, tokens: int, head_tokens: int, seconds: float, rounds: int) -> dict:
    """Per shape and product: GFLOP/s (median over rounds) and the FLOP-weighted efficiency vs the peak
    measured beside each shape."""
    rows = {}
    for name, (out, inp) in shapes.items():
        t = head_tokens if name == "lm_head" else tokens
        count = 1 if name == "lm_head" else layers
        w, x, g = torch.randn(out, inp), torch.randn(t, inp), torch.randn(t, out)
        flops = 2.0 * t * inp * out
        products = {"forward": lambda: torch.mm(x, w.t()), "input_grad": lambda: torch.mm(g, w),
                    "weight_grad": lambda: torch.mm(g.t(), x)}
        for product, fn in products.items():
            rates, peaks = [], []
            for _ in range(rounds):
                peaks.append(square_peak(seconds / 2))
                rates.append(rate(fn, flops, seconds))
            r, p = statistics.median(rates), statistics.median(peaks)
            rows[f"{name}.{product}"] = {"shape": [t, inp, out], "gflops": r / 1e9, "peak_gflops": p / 1e9,
                                         "efficiency": r / p, "calls_per_update": count}
            print(f"{name:8s} {product:12s} [{t}x{inp}]x[{inp}x{out}] {r / 1e9:6.1f} GFLOP/s  "
                  f"peak {p / 1e9:6.1f}  efficiency {r / p:.2f}", flush=True)

    def update_flops(v: dict) -> float:  # one product's FLOPs over all its layers
        return v["calls_per_update"] * 2.0 * v["shape"][0] * v["shape"][1] * v["shape"][2]

    seconds_at_rate = sum(update_flops(v) / (v["gflops"] * 1e9) for v in rows.values())
    seconds_at_peak = sum(update_flops(v) / (v["peak_gflops"] * 1e9) for v in rows.values())
    return {"products": rows, "matmul_gflop_per_micro_batch": sum(update_flops(v) for v in rows.values()) / 1e9,
            "seconds_at_measured_rates": seconds_at_rate, "seconds_at_peak": seconds_at_peak,
            "train_efficiency": seconds_at_peak / seconds_at_rate}


def decode_passes(shapes: dict, layers: int, widths: list[int], repeats: int) -> dict:
    """ms of one pass of every layer's forward products (distinct weights per layer) at each width."""
    weights = [{n: torch.randn(o, i) for n, (o, i) in shapes.items() if n != "lm_head"} for _ in range(layers)]
    head = torch.randn(*shapes["lm_head"])
    nbytes = 4 * (sum(w.numel() for layer in weights for w in layer.values()) + head.numel())
    out = {}
    for width in widths:
        xs = {i: torch.randn(width, i) for _, i in shapes.values()}

        def one_pass():
            for layer in weights:
                for w in layer.values():
                    torch.mm(xs[w.shape[1]], w.t())
            torch.mm(xs[head.shape[1]], head.t())

        one_pass()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - start)
        ms = 1000 * statistics.median(times)
        out[str(width)] = {"ms_per_step": ms, "weight_gb_per_s": nbytes / (ms / 1000) / 1e9}
        print(f"decode width {width:3d}: {ms:6.1f} ms per pass over {nbytes / 1e6:.0f} MB of weights "
              f"({nbytes / (ms / 1000) / 1e9:.1f} GB/s)", flush=True)
    return {"weight_bytes": nbytes, "widths": out}


def bandwidth(repeats: int) -> dict:
    x = torch.randn(64 << 20)  # 256 MB
    y = torch.empty_like(x)
    read, copy = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        read.append(x.numel() * 4 / (time.perf_counter() - start))
        start = time.perf_counter()
        y.copy_(x)
        copy.append(2 * x.numel() * 4 / (time.perf_counter() - start))
    out = {"read_gb_per_s": statistics.median(read) / 1e9, "copy_gb_per_s": statistics.median(copy) / 1e9}
    print(f"memory: read {out['read_gb_per_s']:.1f} GB/s, copy (read + write) {out['copy_gb_per_s']:.1f} GB/s",
          flush=True)
    return out


def _allreduce_rank(rank: int, world: int, port: int, numel: int, bucket: int, repeats: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    grads, times = torch.randn(numel), []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for offset in range(0, numel, bucket):
            dist.all_reduce(grads[offset:offset + bucket])
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def allreduce_seconds(params: int, world: int = 2, bucket_mb: int = 25, repeats: int = 4) -> float:
    """Median seconds for `world` gloo processes (one thread each) to all-reduce `params` fp32 gradients
    in DDP's default 25 MB buckets: the gradient reduction of a whole-replica (DDP) update."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port, params, bucket_mb * (1 << 20) // 4, repeats, out))
             for r in range(world)]
    for proc in procs:
        proc.start()
    seconds = out.get(timeout=600)
    for proc in procs:
        proc.join()
    print(f"all-reduce of {4 * params / 1e6:.0f} MB over {world} gloo processes: {seconds:.3f} s", flush=True)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="a Hugging Face model directory (its config.json)")
    p.add_argument("--tokens", type=int, default=1072, help="tokens of a training micro-batch")
    p.add_argument("--head-tokens", type=int, help="tokens the LM head projects in training (default: --tokens)")
    p.add_argument("--decode-widths", default="1,16,32")
    p.add_argument("--seconds", type=float, default=0.5, help="timing window per measurement")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per training product")
    p.add_argument("--allreduce", action="store_true",
                   help="also time two gloo processes all-reducing the model's gradients (DDP's 25 MB buckets)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    torch.set_num_threads(1)
    shapes, layers, params = layer_shapes(args.model_dir)
    result = {"machine": {"cpu": cpu_info(), "load_avg_start": os.getloadavg()},
              "date": time.strftime("%Y-%m-%d %H:%M"), "model_dir": args.model_dir, "layers": layers,
              "params": params, "tokens": args.tokens, "head_tokens": args.head_tokens or args.tokens}
    result["bandwidth"] = bandwidth(5)
    result["decode"] = decode_passes(shapes, layers, [int(w) for w in args.decode_widths.split(",")], 5)
    result["training"] = training_gemms(shapes, layers, args.tokens, args.head_tokens or args.tokens,
                                        args.seconds, args.rounds)
    result["adamw_floor_s"] = 28.0 * params / (result["bandwidth"]["copy_gb_per_s"] * 1e9)
    if args.allreduce:
        result["allreduce_s"] = allreduce_seconds(params)
    result["machine"]["load_avg_end"] = os.getloadavg()
    print(f"training GEMMs at {result['training']['train_efficiency']:.2f} of the peak (FLOP-weighted); "
          f"AdamW floor {result['adamw_floor_s']:.2f} s for {params / 1e6:.0f} M parameters", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
