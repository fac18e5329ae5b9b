"""AdamW, the learning-rate schedule, and the clip-then-step rule that skips non-finite gradients.

`lr_factor` is the schedule as a pure function of the number of optimizer steps already taken:

* warmup (`warmup_steps = w > 0`): factor = (s + 1) / w for s < w, so the w-th step is the first at
  full learning rate and no step is wasted at lr = 0;
* ``constant``: 1 after warmup;
* ``cosine``: min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2 with
  p = (s - w) / (total_steps - w) clipped to [0, 1].

A step whose total gradient norm is NaN or inf is skipped: gradients are dropped, parameters,
optimizer moments and the schedule stay where they were, and the skip is counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ballast.engine.config import OptimConfig


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier on `cfg.lr` for the optimizer step taken after `step` earlier steps."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    warmup = cfg.warmup_steps
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if cfg.lr_schedule == "constant":
        return 1.0
    total = int(cfg.total_steps)  # validated by OptimConfig
    progress = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    params = [p for p in params if p.requires_grad]
    # On CPU the default AdamW loops over parameters one op at a time; the fused CPU kernel does the
    # whole update in one pass per tensor (about 10x faster at 47 M parameters, equal within float
    # rounding; DTensor shards are supported). GPU keeps torch's default (foreach) kernels.
    on_cpu = bool(params) and all(p.device.type == "cpu" for p in params)
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=True if on_cpu else None,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def total_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """The global L2 norm of all gradients (a collective for sharded DTensor grads); clips if asked."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    if max_norm is not None:
        # clip_grad_norm_ multiplies by a NaN coefficient when the norm is not finite; the caller then
        # drops those gradients, so that is harmless.
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm.detach().float().cpu()


def step_or_skip(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None,
                 stepped: bool) -> None:
    """Step optimizer and schedule when `stepped` (a finite norm); the gradients are dropped either way."""
    if stepped:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def clip_and_step(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    max_norm: float | None,
    replica_group: dist.ProcessGroup | None = None,
) -> tuple[float, bool]:
    """Clip, then step optimizer and schedule unless the norm is not finite. Returns (norm, stepped).

    Every rank of a shard group sees the same global norm, so they take the same branch. Replicas
    (hybrid sharding, `replica_group`) compute it from their own copies of the same gradients, so they
    agree too, but the skip decision is all-reduced across them anyway: replicas that stepped
    differently would drift apart silently for the rest of the run.
    """
    norm = float(total_grad_norm(params, max_norm))
    stepped = math.isfinite(norm)
    if replica_group is not None:
        flag = torch.tensor([0.0 if stepped else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=replica_group)
        stepped = bool(flag.item() == 0.0)
    step_or_skip(optimizer, scheduler, stepped)
    return norm, stepped
