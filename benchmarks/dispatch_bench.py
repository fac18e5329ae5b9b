"""Dispatch round-trip throughput: a 256 MB Batch driver -> 4 workers -> driver through
DP_COMPUTE_PROTO, against raw `ray.put`/`ray.get` of the same tensors through the same actors.

Both sides move the same bytes over the same path: the driver puts 4 chunks, each worker receives
its chunk and returns it unchanged, the driver gets the 4 results (and, for the Batch, concatenates
them into one Batch: that copy is part of what a user pays). Throughput counts payload bytes once
per direction: 2 x 256 MB per round trip. `raw` sends the torch tensors themselves (the baseline the
issue names; torch pickles storages through an in-memory torch.save); `raw_numpy` sends the same
bytes as numpy arrays, Ray's zero-copy best case, reported as a second, stricter baseline.

    python benchmarks/dispatch_bench.py [--json PATH] [--repeats 5] [--mb 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from ballast.protocol import Batch  # noqa: E402
from ballast.trainer.run.ray_session import open_local_ray  # noqa: E402
from ballast.single_controller import Dispatch, RayWorkerGroup, ResourcePool, Worker, register  # noqa: E402


class EchoWorker(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def echo(self, batch: Batch) -> Batch:
        return batch

    @register(Dispatch.ALL_TO_ALL)
    def echo_raw(self, tensors: dict) -> dict:
        return tensors


def make_batch(total_mb: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    rows = 8192
    cols = total_mb * 2**20 // 2 // rows // 4  # half the bytes in float32, half in int64
    floats = torch.randn(rows, cols, generator=g)
    ints = torch.randint(0, 50_000, (rows, cols // 2), generator=g)
    return Batch({"log_probs": floats, "input_ids": ints}, {"uid": [f"u{i}" for i in range(rows)]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the result as JSON to this path")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()

    session = open_local_ray(num_cpus=args.workers, include_dashboard=False, log_to_driver=False,
                             object_store_memory=max(2 * 2**30, 6 * args.mb * 2**20))
    sys.modules.setdefault("dispatch_bench", sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    pool = ResourcePool([args.workers], use_gpu=False, name="bench")
    group = RayWorkerGroup(pool, EchoWorker, name="bench")
    batch = make_batch(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in batch.tensors.values())
    chunks = [{k: v.contiguous() for k, v in c.tensors.items()} for c in batch.chunk(args.workers)]

    def ours():
        out = group.echo(batch)
        assert len(out) == len(batch)

    def raw():
        refs = [ray.put(c) for c in chunks]
        results = group.echo_raw(refs)  # top-level refs are resolved inside each worker
        assert sum(r["log_probs"].shape[0] for r in results) == len(batch)

    numpy_chunks = [{k: v.numpy() for k, v in c.items()} for c in chunks]

    def raw_numpy():
        # The best case Ray offers: numpy arrays travel zero-copy (pickle 5 out-of-band buffers).
        refs = [ray.put(c) for c in numpy_chunks]
        results = group.echo_raw(refs)
        assert sum(r["log_probs"].shape[0] for r in results) == len(batch)

    timings = {}
    for name, fn in (("raw", raw), ("raw_numpy", raw_numpy), ("dispatch", ours)):
        fn()  # warm-up: worker start, first object-store allocation
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        timings[name] = statistics.median(samples)
    gb = 2 * nbytes / 1e9
    result = {
        "payload_mb": nbytes / 2**20, "workers": args.workers, "repeats": args.repeats,
        "dispatch_seconds": timings["dispatch"], "raw_seconds": timings["raw"],
        "dispatch_gb_per_s": gb / timings["dispatch"], "raw_gb_per_s": gb / timings["raw"],
        "raw_numpy_gb_per_s": gb / timings["raw_numpy"],
    }
    result["ratio"] = result["dispatch_gb_per_s"] / result["raw_gb_per_s"]
    result["ratio_vs_numpy"] = result["dispatch_gb_per_s"] / result["raw_numpy_gb_per_s"]
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    group.kill()
    pool.remove()
    session.stop()


if __name__ == "__main__":
    main()
