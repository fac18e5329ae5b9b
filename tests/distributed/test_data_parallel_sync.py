"""The data-parallel strategy's gradient sync on two CPU ranks, for FSDP2 and DDP (whole replicas).

Three micro-batches go through `DataParallel.gradient_sync(last)` with the gradient reductions
counted (all-reduce and reduce-scatter calls): both modes defer on CPU and reduce in the last
micro-batch only. FSDP2 reducing after every backward (`defer_reduction=False`, the GPU setting)
reduces in each and leaves the same summed gradient. A micro-batch that fails inside the scope
leaves gradient sync switched back on (the next plain backward reduces).
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist
import transformers

from ballast.engine import EngineConfig, TrainEngine
from ballast.engine.forward import ForwardOptions, forward_micro_batch
from testkit.engine import full, make_rl_batch, spawn_ranks
from testkit.models import build_tiny_causal_lm

# Progress bars start tqdm's monitor thread; without it the ranks can be forked (fast).
transformers.utils.logging.disable_progress_bar()

REDUCTIONS = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor")
OPTS = ForwardOptions(is_critic=False, use_remove_padding=True, temperature=1.0, calculate_entropy=False,
                      chunk_tokens=64)


def _count_reductions() -> dict[str, int]:
    """Wrap the reduction collectives of `torch.distributed` so that every call is counted."""
    counts = {"n": 0}
    for name in REDUCTIONS:
        if hasattr(dist, name):
            original = getattr(dist, name)

            def counted(*args, _original=original, **kwargs):
                counts["n"] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
    return counts


def _micro_batches(rank: int):
    data = make_rl_batch([4, 9, 6], [7, 3, 5], vocab_size=128, seed=100 + rank)
    return [data[i : i + 1] for i in range(3)]


def _backward(engine, strategy, micro) -> None:
    outputs = forward_micro_batch(strategy.module, micro, OPTS, engine.parallel)
    (outputs["log_probs"] * micro["response_mask"]).sum().backward()


def _mini_batch(engine, strategy, micros, counts) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Reductions per micro-batch, and the summed gradient (whole tensors)."""
    per_micro = []
    engine.zero_grad()
    for index, micro in enumerate(micros):
        before = counts["n"]
        with strategy.gradient_sync(last=index == len(micros) - 1):
            _backward(engine, strategy, micro)
        per_micro.append(counts["n"] - before)
    grads = {name: full(p.grad).clone() for name, p in engine.model.named_parameters()}
    engine.zero_grad()
    return per_micro, grads


def _worker(rank, world, root, model_dir):
    counts = _count_reductions()
    micros = _micro_batches(rank)
    report = {}
    for fsdp_size in (-1, 1):
        engine = TrainEngine(EngineConfig(model_path=model_dir, device="cpu", fsdp_size=fsdp_size))
        engine.model.train()
        strategy = engine.data_parallel
        once, grads_once = _mini_batch(engine, strategy, micros, counts)
        result = dict(defer=strategy.defer_reduction, once=once)
        if engine.data_parallel_mode == "fsdp":
            every, grads_every = _mini_batch(engine, dataclasses.replace(strategy, defer_reduction=False), micros,
                                             counts)
            result.update(every=every, grad_scale=max(float(g.abs().max()) for g in grads_every.values()),
                          grad_diff=max(float((grads_once[n] - grads_every[n]).abs().max()) for n in grads_once))
        # a failure inside a deferring scope must not leave the reduction switched off
        try:
            with strategy.gradient_sync(last=False):
                raise RuntimeError("micro-batch failed")
        except RuntimeError:
            pass
        before = counts["n"]
        _backward(engine, strategy, micros[0])
        after_failure = counts["n"] - before
        report[str(engine.data_parallel_mode)] = dict(result, after_failure=after_failure)
    if rank == 0:
        with open(os.path.join(root, "report.json"), "w") as f:
            json.dump(report, f)


def test_reduction_once_per_mini_batch_in_the_last_micro_batch(tmp_path):
    model_dir = build_tiny_causal_lm(str(tmp_path / "model"), seed=3)
    spawn_ranks(_worker, 2, args=(str(tmp_path), model_dir), timeout_s=240)
    with open(tmp_path / "report.json") as f:
        report = json.load(f)
    assert sorted(report) == ["ddp", "fsdp"]
    for mode, r in report.items():
        assert r["defer"], mode  # both defer on CPU
        assert r["once"][:2] == [0, 0] and r["once"][2] > 0, (mode, r["once"])
        assert r["after_failure"] > 0, (mode, r)
    fsdp = report["fsdp"]
    assert all(n > 0 for n in fsdp["every"]), fsdp["every"]
    assert fsdp["grad_diff"] <= 1e-6 * fsdp["grad_scale"], fsdp
