"""The `update_*` loop shared by actor and critic: epochs x mini-batches of this rank's share.

Pure bookkeeping around the engine: which rows form each mini-batch (optionally shuffled with
seed + dp rank, so DP ranks shuffle differently but reproducibly), one optimizer step per
mini-batch, one learning-rate schedule step per call (the schedule's warmup and length are counted
in training steps, as verl's), and metrics averaged over mini-batches (each engine metric is already
a mini-batch-global value, identical on every DP rank); running counters report their last value.

With a central plan from the driver (`plans`, shipped in `meta[MINI_BATCH_PLANS_KEY]`), the driver
has already cut, shuffled and laid out the mini-batches of every epoch: mini-batch m is rows
[m * size, (m + 1) * size) of this rank's data and runs the micro-batches `plans[m]` names.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import numpy as np
from tensordict import TensorDict

from ballast.workers.spec import TrainLoopSpec


def mini_batch_indices(num_samples: int, mini_batch_samples: int, epochs: int, shuffle: bool,
                       seed: int) -> Iterator[np.ndarray]:
    """Row indices of every mini-batch, epoch by epoch; every row exactly once per epoch."""
    if num_samples % mini_batch_samples:
        raise ValueError(
            f"this rank holds {num_samples} samples, not a multiple of mini_batch_samples_per_rank="
            f"{mini_batch_samples}: the dispatched step does not match the derived sizes"
        )
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(num_samples) if shuffle else np.arange(num_samples)
        for start in range(0, num_samples, mini_batch_samples):
            yield order[start:start + mini_batch_samples]


def adaptive_grad_clip(grad_clip: float, num_samples: int, min_batch_size: int | None) -> float:
    """The clip threshold for a mini-batch of `num_samples` (global): linear below the minimum."""
    if min_batch_size is None or num_samples >= min_batch_size:
        return grad_clip
    return grad_clip * num_samples / min_batch_size


MINI_BATCH_PLANS_KEY = "mini_batch_plans"
# The driver's central plan of the old-log-prob pass (the whole step as one mini-batch), in meta.
LOG_PROB_PLAN_KEY = "log_prob_micro_batch_plan"
GIB = 1024**3


@dataclass
class UpdateResult:
    """What one `update_*` call returns to the driver (from every DP rank's collect worker)."""

    metrics: Dict[str, float]            # averaged over mini-batches; identical on every DP rank
    micro_batch_tokens: List[List[int]]  # real tokens of every micro-batch, one list per DP rank
    # the actor's log-probs of the rows whose old log-probs came from the update (see workers.on_policy)
    update_log_probs: Optional[object] = None


def memory_metrics() -> Dict[str, float]:
    """verl's perf/max_memory_{allocated,reserved}_gb (this process's CUDA peak; only on CUDA) and
    perf/cpu_memory_used_gb (the host's used memory)."""
    import torch

    metrics: Dict[str, float] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / GIB
        metrics["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / GIB
    try:
        import psutil
    except ImportError:  # psutil comes with vllm; without it the host figure is left out
        return metrics
    metrics["perf/cpu_memory_used_gb"] = psutil.virtual_memory().used / GIB
    return metrics


def _planned_mini_batches(num_samples: int, mini_batch_samples: int, plans: list) -> Iterator[np.ndarray]:
    if num_samples != len(plans) * mini_batch_samples:
        raise ValueError(
            f"this rank holds {num_samples} samples but the central plan has {len(plans)} mini-batches of "
            f"mini_batch_samples_per_rank={mini_batch_samples}"
        )
    for m in range(len(plans)):
        yield np.arange(m * mini_batch_samples, (m + 1) * mini_batch_samples)


def run_train_loop(engine, data: TensorDict, spec: TrainLoopSpec, dp_rank: int, prefix: str,
                   plans: Optional[list] = None) -> UpdateResult:
    """Train on `data` (this rank's share of the step), planning per rank or following `plans`.

    Returns metrics averaged over mini-batches and the real tokens of every micro-batch each DP rank
    ran during the whole update (one list per DP rank).
    """
    history: Dict[str, List[float]] = defaultdict(list)
    micro_tokens: List[List[int]] = []
    if plans is None:
        indices = mini_batch_indices(data.batch_size[0], spec.mini_batch_samples_per_rank, spec.ppo_epochs,
                                     spec.shuffle, spec.seed + dp_rank)
    else:
        indices = _planned_mini_batches(data.batch_size[0], spec.mini_batch_samples_per_rank, plans)
    skipped_total = None
    for m, rows in enumerate(indices):
        engine.zero_grad()
        out = engine.forward_backward_batch(data[rows], spec.loss_fn, spec.micro, temperature=spec.temperature,
                                            calculate_entropy=spec.calculate_entropy,
                                            plan=None if plans is None else plans[m])
        clip = None
        if spec.grad_clip_min_batch_size is not None and engine.cfg.grad_clip is not None:
            clip = adaptive_grad_clip(engine.cfg.grad_clip, int(out["num_sequences"]), spec.grad_clip_min_batch_size)
        step = engine.optimizer_step(grad_clip=clip, step_scheduler=False)
        for rank, tokens in enumerate(engine.last_micro_batch_tokens):
            if rank == len(micro_tokens):
                micro_tokens.append([])
            micro_tokens[rank].extend(tokens)
        for key, value in out.items():
            name = key if "/" in key else f"{prefix}/{key}"
            history[name].append(value)
        history[f"{prefix}/grad_norm"].append(step["grad_norm"])
        history[f"{prefix}/lr"].append(step["lr"])
        history[f"{prefix}/step_skipped"].append(step["step_skipped"])
        skipped_total = step["skipped_steps"]
        if clip is not None:
            history[f"{prefix}/grad_clip_effective"].append(clip)
    engine.lr_scheduler_step()
    history.update({k: [v] for k, v in memory_metrics().items()})
    result: Dict[str, float] = {key: float(np.mean(values)) for key, values in history.items()}
    if skipped_total is not None:  # a running count: its mean over mini-batches would mean nothing
        result[f"{prefix}/skipped_steps_total"] = float(skipped_total)
    return UpdateResult(result, micro_tokens)
