"""Engine test helpers (also used by the engine demo and benchmark): synthetic RL batches in the
engine's layout, reference log-probs from a plain HF model, and a process launcher.

`spawn_ranks` starts a gloo "torchrun" in-process (one spawned process per rank, a FileStore for
rendezvous) and enforces a wall-clock deadline: a rank that hangs in a collective is killed and the
call raises, so a hang is a test failure rather than a stuck CI job.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.multiprocessing as mp
from tensordict import TensorDict


def whole_batch_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, horizon: float) -> torch.Tensor:
    """A mini-batch's loss written directly from each aggregation mode's definition, over all rows at
    once (differentiable): the reference the engines' per-micro-batch shares must add up to."""
    masked = loss_mat * mask
    if mode == "token-mean":
        return masked.sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).mean()
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    return masked.sum(-1).mean() / horizon


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 DTensor (collective), or a replica's plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor, or a replica's plain tensor itself (writes go through)."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def make_rl_batch(
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    vocab_size: int,
    seed: int = 0,
    prompt_width: int | None = None,
    response_width: int | None = None,
) -> TensorDict:
    """A padded batch in the engine's layout with random tokens and per-token `advantages`.

    Prompts are left-padded to `prompt_width` (P), responses right-padded to `response_width` (R);
    `position_ids` count real tokens from 0; `response_mask` marks real response tokens.
    """
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(response_lens)} response lengths")
    gen = np.random.default_rng(seed)
    batch = len(prompt_lens)
    p_w = prompt_width or max(prompt_lens)
    r_w = response_width or max(response_lens)
    input_ids = torch.zeros(batch, p_w + r_w, dtype=torch.int64)
    attention_mask = torch.zeros(batch, p_w + r_w, dtype=torch.int64)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        if not (1 <= p <= p_w and 0 <= r <= r_w):
            raise ValueError(f"row {b}: prompt {p} / response {r} do not fit widths P={p_w}, R={r_w}")
        input_ids[b, p_w - p : p_w + r] = torch.from_numpy(gen.integers(1, vocab_size, p + r))
        attention_mask[b, p_w - p : p_w + r] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    advantages = torch.from_numpy(gen.standard_normal((batch, r_w))).float()
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "responses": input_ids[:, p_w:].clone(),
            "response_mask": attention_mask[:, p_w:].clone(),
            "advantages": advantages,
        },
        batch_size=[batch],
    )


def reference_log_probs(model, data: TensorDict, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) log-probs and entropies of the response tokens from a plain HF causal LM.

    Independent of the engine: each sample runs alone without padding and the full-vocab
    log_softmax is taken directly. Differentiable; padding slots are 0.
    """
    R = data["responses"].shape[1]
    P = data["input_ids"].shape[1] - R
    lp_rows, ent_rows = [], []
    for b in range(data.batch_size[0]):
        keep = data["attention_mask"][b].bool()
        ids = data["input_ids"][b][keep][None]
        p, r = int(keep[:P].sum()), int(keep[P:].sum())
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float() / temperature, -1)
        lp = logp[p - 1 : p - 1 + r].gather(-1, ids[0, p : p + r, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)[p - 1 : p - 1 + r]
        lp_rows.append(torch.nn.functional.pad(lp, (0, R - r)))
        ent_rows.append(torch.nn.functional.pad(ent, (0, R - r)))
    return torch.stack(lp_rows), torch.stack(ent_rows)


def _rank_entry(
    rank: int, world: int, store_path: str, fn: Callable, args: tuple, threads: int, backend: str
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS=str(threads),
    )
    torch.set_num_threads(threads)
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "cuda:nccl,cpu:gloo"  # as ballast.engine.dist.init_distributed: CPU offload needs gloo
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def _fork_is_safe() -> bool:
    import threading

    import torch.distributed as dist

    return (
        sys.platform.startswith("linux")
        and threading.active_count() == 1
        and not (dist.is_available() and dist.is_initialized())
        and not torch.cuda.is_initialized()
    )


def spawn_ranks(
    fn: Callable,
    world_size: int,
    args: tuple = (),
    timeout_s: float = 300.0,
    threads: int = 1,
    start_method: str = "auto",
    backend: str = "gloo",
) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks with a gloo (or nccl) process group.

    Raises RuntimeError if any rank fails or if they have not all finished after `timeout_s` (the
    stragglers are killed first). `fn` must be importable (a module-level function). With "spawn"
    every rank imports torch/transformers afresh (~5-15 s on a busy 2-core box); "fork" reuses the
    parent's imports and is safe only while the parent runs no other threads, has no process group
    and no CUDA context. "auto" forks when that holds and spawns otherwise. `backend="nccl"` puts
    rank r on GPU r % device_count and always spawns.
    """
    if start_method == "auto":
        start_method = "fork" if backend == "gloo" and _fork_is_safe() else "spawn"
    if backend == "nccl" and start_method != "spawn":
        raise ValueError("CUDA ranks must be started with start_method='spawn'")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(
            _rank_entry, args=(world_size, store, fn, args, threads, backend), nprocs=world_size,
            join=False, start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
                    raise RuntimeError(
                        f"ranks {alive} of {world_size} still running after {timeout_s:.0f} s "
                        "(a collective that not every rank entered?); killed"
                    )
        except mp.ProcessRaisedException as exc:
            raise RuntimeError(f"a rank failed:\n{exc}") from None
        except mp.ProcessExitedException as exc:
            raise RuntimeError(f"a rank exited abnormally: {exc}") from None
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)


def schedule_probe_engine(optim):
    """A `TrainEngine` around a one-weight model whose forward/backward only records the learning
    rate and sets a unit gradient: the real optimizer_step / lr_scheduler_step without a process group
    (`engine.seen_lrs` lists the learning rate of every mini-batch)."""
    from ballast.engine.config import EngineConfig
    from ballast.engine.engine import TrainEngine
    from ballast.engine.optim import build_optimizer, build_scheduler

    engine = object.__new__(TrainEngine)
    engine.cfg = EngineConfig(model_path="unused", optim=optim, grad_clip=1.0, device="cpu")
    engine.model = torch.nn.Linear(2, 1, bias=False)
    engine.optimizer = build_optimizer(engine.model.parameters(), optim)
    engine.scheduler = build_scheduler(engine.optimizer, optim)
    engine.global_step = engine.skipped_steps = 0
    engine.last_micro_batch_tokens = [[1]]
    engine.parallel = types.SimpleNamespace(replica_group=None, dp_rank=0)  # one process: no replicas to agree with
    engine.seen_lrs = []

    def forward_backward_batch(data, loss_fn, plan, **_):
        engine.seen_lrs.append(engine.optimizer.param_groups[0]["lr"])
        engine.model.weight.grad = torch.ones_like(engine.model.weight)
        return {"loss": 0.0, "num_sequences": float(data.batch_size[0])}

    engine.forward_backward_batch = forward_backward_batch
    return engine
