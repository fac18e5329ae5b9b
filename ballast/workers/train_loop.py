"""The `update_*` loop shared by actor and critic: execute the driver's plan of this rank's share.

Pure bookkeeping around the engine. The driver's `PhasePlan` (from `ballast.balance.plan_phase`)
already fixed every epoch's mini-batches and their micro-batches: this rank's data is its chunk of
`batch[plan.rows]`, mini-batch m is the next `plan.mini_batches[m].rows_per_rank[rank]` rows, and
nothing here cuts, shuffles or re-plans. One optimizer step per mini-batch, one learning-rate
schedule step per call (the schedule's warmup and length are counted in training steps, as verl's),
and metrics averaged over mini-batches (each engine metric is already a mini-batch-global value,
identical on every DP rank); running counters report their last value.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import numpy as np
import torch
from tensordict import TensorDict

from ballast.engine import MiniBatchPlan, PhasePlan
from ballast.workers.on_policy import LogProbRecorder
from ballast.workers.spec import TrainLoopSpec


def rank_mini_batches(plan: PhasePlan, dp_rank: int, num_rows: int) -> Iterator[tuple[np.ndarray, MiniBatchPlan]]:
    """(rows of this rank's data, the mini-batch's plan) for every mini-batch, in execution order."""
    sizes = [mb.rows_per_rank[dp_rank] for mb in plan.mini_batches]
    if num_rows != sum(sizes):
        raise ValueError(f"DP rank {dp_rank} holds {num_rows} rows but its plan covers {sum(sizes)}: "
                         "the dispatched batch does not match the plan")
    start = 0
    for size, mini_batch in zip(sizes, plan.mini_batches):
        yield np.arange(start, start + size), mini_batch
        start += size


def adaptive_grad_clip(grad_clip: float, num_samples: int, min_batch_size: int | None) -> float:
    """The clip threshold for a mini-batch of `num_samples` (global): linear below the minimum."""
    if min_batch_size is None or num_samples >= min_batch_size:
        return grad_clip
    return grad_clip * num_samples / min_batch_size


GIB = 1024**3


@dataclass
class UpdateResult:
    """What one `update_*` call returns to the driver (from every DP rank's collect worker)."""

    metrics: Dict[str, float]            # averaged over mini-batches; identical on every DP rank
    micro_batch_tokens: List[List[int]]  # real tokens of every micro-batch, one list per DP rank
    # When the update computed the old log-probs itself (see workers.on_policy): this rank's rows, in
    # its dispatch order, (rows, R) each.
    old_log_probs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    # With `record_log_probs`: the log-probs each row had when it was trained in the first epoch, this
    # rank's first-epoch rows in dispatch order, (rows, R).
    train_log_probs: Optional[torch.Tensor] = None


def memory_metrics() -> Dict[str, float]:
    """verl's perf/max_memory_{allocated,reserved}_gb (this process's CUDA peak; only on CUDA) and
    perf/cpu_memory_used_gb (the host's used memory), plus perf/max_rss_gb: this worker process's peak
    resident memory since it started (the trainer, its rollout engine and their buffers)."""
    import resource

    import torch

    # Linux reports ru_maxrss in KiB.
    metrics: Dict[str, float] = {"perf/max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / GIB
        metrics["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / GIB
    try:
        import psutil
    except ImportError:  # psutil comes with vllm; without it the host figure is left out
        return metrics
    metrics["perf/cpu_memory_used_gb"] = psutil.virtual_memory().used / GIB
    return metrics


def run_train_loop(engine, data: TensorDict, plan: PhasePlan, spec: TrainLoopSpec, prefix: str,
                   first_loss_fn=None, later_old_log_probs: Optional[torch.Tensor] = None,
                   record_log_probs: bool = False) -> UpdateResult:
    """Train on `data` (this rank's chunk of the phase) following `plan`. When the update supplies the
    old log-probs itself, `first_loss_fn` replaces `spec.loss_fn` in the first mini-batch (it makes
    them) and `later_old_log_probs` are those of the rows after it (one epoch: rows first..end).
    `record_log_probs` keeps the log-probs of every first-epoch row as it was trained
    (`UpdateResult.train_log_probs`).

    Returns metrics averaged over mini-batches and the real tokens of every micro-batch each DP rank
    ran during the whole update (one list per DP rank).
    """
    history: Dict[str, List[float]] = defaultdict(list)
    micro_tokens: List[List[int]] = []
    skipped_total = None
    first_rows = plan.mini_batches[0].rows_per_rank[engine.parallel.dp_rank]
    recorded: List[torch.Tensor] = []
    first_epoch = len(plan.mini_batches) // plan.epochs
    for m, (rows, mini_batch) in enumerate(rank_mini_batches(plan, engine.parallel.dp_rank, data.batch_size[0])):
        engine.zero_grad()
        loss_fn = first_loss_fn if m == 0 and first_loss_fn is not None else spec.loss_fn
        recorder = LogProbRecorder(loss_fn) if record_log_probs and m < first_epoch else None
        loss_fn = recorder or loss_fn
        entropy = spec.calculate_entropy or (m == 0 and first_loss_fn is not None)
        mini_data = data[torch.as_tensor(rows)]
        if later_old_log_probs is not None and m > 0:
            mini_data.set("old_log_probs", later_old_log_probs[torch.as_tensor(rows - first_rows)])
        out = engine.forward_backward_batch(mini_data, loss_fn, mini_batch,
                                            temperature=spec.temperature, calculate_entropy=entropy)
        if recorder is not None and engine.parallel.collects:  # a pipeline's loss runs on its last stage
            recorded.append(recorder.collect(mini_batch.for_rank(engine.parallel.dp_rank), data["responses"].shape[1]))
        clip = None
        if spec.grad_clip_min_batch_size is not None and engine.cfg.grad_clip is not None:
            clip = adaptive_grad_clip(engine.cfg.grad_clip, int(out["num_sequences"]), spec.grad_clip_min_batch_size)
        step = engine.optimizer_step(grad_clip=clip, step_scheduler=False)
        for rank, tokens in enumerate(engine.last_micro_batch_tokens):
            if rank == len(micro_tokens):
                micro_tokens.append([])
            micro_tokens[rank].extend(tokens)
        for key, value in out.items():
            history[key if "/" in key else f"{prefix}/{key}"].append(value)
        for key in ("grad_norm", "lr", "step_skipped"):
            history[f"{prefix}/{key}"].append(step[key])
        skipped_total = step["skipped_steps"]
        if clip is not None:
            history[f"{prefix}/grad_clip_effective"].append(clip)
    engine.lr_scheduler_step()
    history.update({k: [v] for k, v in memory_metrics().items()})
    result: Dict[str, float] = {key: float(np.mean(values)) for key, values in history.items()}
    if skipped_total is not None:  # a running count: its mean over mini-batches would mean nothing
        result[f"{prefix}/skipped_steps_total"] = float(skipped_total)
    return UpdateResult(result, micro_tokens, train_log_probs=torch.cat(recorded) if recorded else None)
