"""Model FLOPs utilisation of a worker's passes (verl's `perf/mfu/*` metrics).

MFU = the model FLOPs a pass needed (forward FLOPs of its samples from the model's config, each
shared prompt once, times 3 for forward + backward) / (its wall seconds x the device's peak). The
peak is measured once at start-up on CPU (best fp32 matmul rate on the worker's own threads, so the
figure is against what these cores really sustain) and looked up in a table of dense bf16
spec-sheet numbers on GPU.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from ballast.engine.shared_prefix import row_prompts

# Dense bf16 tensor-core peak FLOP/s from the vendors' spec sheets, by device-name substring.
GPU_PEAK_FLOPS = (
    ("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("A100", 312e12), ("A800", 312e12),
    ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12), ("A10", 125e12), ("4090", 165e12),
)


def cpu_matmul_peak_flops(size: int = 1024, seconds: float = 0.5) -> float:
    """Best fp32 matmul FLOP/s of this process's current torch threads (best of repeated square
    matmuls: on a shared machine, the rate of the least disturbed one)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2.0 * size**3 / max(time.perf_counter() - start, 1e-9))
    return best


def peak_flops(device_type: str) -> Optional[float]:
    """The per-process peak MFU is measured against; None for an unknown GPU (no MFU reported)."""
    if device_type == "cpu":
        return cpu_matmul_peak_flops()
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((flops for key, flops in GPU_PEAK_FLOPS if key in name), None)


def pass_flops(engine, data, passes: float, shared_prompts: bool = False) -> Optional[float]:
    """`passes` x the forward FLOPs of these rows (None when the engine has no FLOPs model). With
    `shared_prompts` (the plan ran each prompt once) a prompt's forward counts once per group, not
    once per row: what the pass needed."""
    if not callable(engine.workload):
        return None
    lengths = data["attention_mask"].sum(-1).cpu().numpy()
    if not len(lengths):
        return 0.0
    flops = float(engine.workload(lengths).sum())
    if shared_prompts:  # every row but the first of each group repeated its prompt's forward
        prompt_ids, prompt_lengths = row_prompts(data)
        _, first, counts = np.unique(prompt_ids, return_index=True, return_counts=True)
        flops -= float(((counts - 1) * engine.workload(prompt_lengths[first])).sum())
    return passes * flops


def mfu_metrics(name: str, engine, data, seconds: float, peak: Optional[float], passes: float,
                shared_prompts: bool = False) -> Dict[str, float]:
    """`perf/mfu/{name}` over the engine's whole mesh. Collective over the DP group (one all-reduce)."""
    flops = pass_flops(engine, data, passes, shared_prompts)
    if flops is None or not peak or seconds <= 0:
        return {}
    parallel = engine.parallel
    total = torch.tensor([flops], dtype=torch.float64, device=parallel.device)
    if parallel.dp_size > 1:
        dist.all_reduce(total, group=parallel.dp_group)
    # SP (and pipeline) peers hold the same rows: count them once (dp sum), but every rank's peak is available.
    return {f"perf/mfu/{name}": float(total[0]) / (seconds * peak * parallel.world_size)}
