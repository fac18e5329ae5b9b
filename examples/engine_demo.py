"""A few optimizer steps of the engine under torchrun, printing the loss per step.

    torchrun --nproc_per_node 2 examples/engine_demo.py --sp 2 --dynamic
    torchrun --nproc_per_node 2 examples/engine_demo.py --micro-batch-size 2 --no-remove-padding

The model is the cached tiny Qwen2 of `ballast.models` (or `--model DIR`); the data is a synthetic
batch with long-tailed lengths, identical on every rank and split over the DP ranks. The objective
is the token-mean negative log-likelihood of the responses (advantage 1 everywhere), so the printed
loss should fall step after step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from ballast.engine import EngineConfig, MicroBatchSpec, OptimConfig, TrainEngine, agg_loss

# The synthetic batch builder is the engine tests' (tests/testkit), kept out of the installed package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from testkit.engine import make_rl_batch  # noqa: E402


def nll_loss(outputs, micro, norm):
    mask = micro["response_mask"]
    loss = agg_loss(-outputs["log_probs"], mask, "token-mean", norm)
    return loss, {"entropy": agg_loss(outputs["entropy"], mask, "token-mean", norm)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: cached tiny Qwen2)")
    parser.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel size")
    parser.add_argument("--dynamic", action="store_true", help="token-budget dynamic micro-batches")
    parser.add_argument("--max-token-len-per-gpu", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2, help="static micro-batch size per GPU")
    parser.add_argument("--no-remove-padding", action="store_true")
    parser.add_argument("--samples", type=int, default=16, help="mini-batch size (all ranks together)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def synthetic_batch(num_samples: int, vocab_size: int, seed: int, max_len: int = 120):
    """Log-normal total lengths (max/median well above 4), prompts 10-40% of each sample."""
    rng = np.random.default_rng(seed)
    totals = np.clip(np.round(rng.lognormal(mean=3.3, sigma=0.8, size=num_samples)), 4, max_len).astype(int)
    prompts = np.maximum(1, np.round(totals * rng.uniform(0.1, 0.4, num_samples))).astype(int)
    return make_rl_batch(prompts.tolist(), (totals - prompts).tolist(), vocab_size=vocab_size, seed=seed)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.model is None:
        from ballast.models import tiny_model_dir

        args.model = str(tiny_model_dir("tiny"))
    import transformers

    transformers.utils.logging.disable_progress_bar()
    cfg = EngineConfig(
        model_path=args.model,
        use_remove_padding=not args.no_remove_padding,
        ulysses_sequence_parallel_size=args.sp,
        optim=OptimConfig(lr=args.lr, warmup_steps=1),
    )
    engine = TrainEngine(cfg, seed=args.seed)
    par = engine.parallel
    vocab = engine.model.config.vocab_size
    data = synthetic_batch(args.samples, vocab, args.seed)
    if args.samples % par.dp_size:
        raise ValueError(f"--samples={args.samples} must divide by the dp size {par.dp_size}")
    rows = args.samples // par.dp_size
    local = data[par.dp_rank * rows : (par.dp_rank + 1) * rows]
    if args.dynamic:
        spec = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=args.max_token_len_per_gpu)
    else:
        spec = MicroBatchSpec(micro_batch_size_per_gpu=args.micro_batch_size)
    rank0 = dist.get_rank() == 0
    if rank0:
        lengths = data["attention_mask"].sum(-1)
        print(
            f"[demo] world={dist.get_world_size()} dp={par.dp_size} sp={par.sp_size} spec={spec} "
            f"rmpad={cfg.use_remove_padding} samples={args.samples} tokens={int(lengths.sum())} "
            f"len min/median/max={int(lengths.min())}/{int(lengths.median())}/{int(lengths.max())}",
            flush=True,
        )
    for step in range(args.steps):
        start = time.perf_counter()
        metrics = engine.forward_backward_batch(local, nll_loss, engine.plan_micro_batches(local, spec), calculate_entropy=True)
        opt = engine.optimizer_step()
        if rank0:
            print(
                f"[demo] step {step + 1}: loss={metrics['loss']:.4f} entropy={metrics['entropy']:.3f} "
                f"grad_norm={opt['grad_norm']:.3f} lr={opt['lr']:.2e} "
                f"micro_batches={int(metrics['num_micro_batches'])} time={time.perf_counter() - start:.2f}s",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
