"""A tied embedding's sparse lookup gradient on two CPU ranks, under FSDP2 and DDP (whole replicas).

On CPU `parallelize` makes a trainable tied input embedding's lookup gradient sparse, so that the
vocabulary matrix is not zero-filled and added in whole once more per backward. The parameter's
gradient must still be dense and equal (to float rounding) to what the dense lookup gives, every
other parameter's gradient must be bitwise the same, and the optimizer must step on it. The same mini-batch
(three micro-batches, reduction deferred to the last) runs with the sparse lookup and then with it
switched back to dense, on each rank's own rows.
"""

from __future__ import annotations

import json
import os

import torch
import transformers

from ballast.engine import EngineConfig, TrainEngine
from ballast.engine.forward import ForwardOptions, forward_micro_batch
from testkit.engine import full, make_rl_batch, spawn_ranks
from testkit.models import build_tiny_causal_lm

# Progress bars start tqdm's monitor thread; without it the ranks can be forked (fast).
transformers.utils.logging.disable_progress_bar()

OPTS = ForwardOptions(is_critic=False, use_remove_padding=True, temperature=1.0, calculate_entropy=True,
                      chunk_tokens=64)


def _gradients(engine, micros) -> dict[str, torch.Tensor]:
    strategy = engine.data_parallel
    engine.zero_grad()
    for index, micro in enumerate(micros):
        with strategy.gradient_sync(last=index == len(micros) - 1):
            out = forward_micro_batch(strategy.module, micro, OPTS, engine.parallel)
            loss = -(micro["advantages"] * out["log_probs"] + 0.01 * out["entropy"]) * micro["response_mask"]
            loss.sum().backward()
    grads = {}
    for name, p in engine.model.named_parameters():
        if p.grad is not None:
            assert not p.grad.is_sparse, name
            grads[name] = full(p.grad).clone()
    return grads


def _worker(rank, world, root, tied_dir, untied_dir):
    data = make_rl_batch([4, 9, 6, 12], [7, 3, 5, 9], vocab_size=128, seed=100 + rank)
    micros = [data[0:1], data[1:3], data[3:4]]
    report = {}
    for fsdp_size in (-1, 1):
        engine = TrainEngine(EngineConfig(model_path=tied_dir, device="cpu", fsdp_size=fsdp_size))
        engine.model.train()
        embedding = engine.model.get_input_embeddings()
        sparse_by_default = bool(embedding.sparse)
        sparse = _gradients(engine, micros)
        embedding.sparse = False
        dense = _gradients(engine, micros)
        embedding.sparse = True
        tied = [n for n in sparse if "embed_tokens" in n]
        assert len(tied) == 1, sorted(sparse)
        before = full(engine.model.get_input_embeddings().weight).clone()
        _gradients(engine, micros)
        engine.optimizer_step()
        moved = float((full(engine.model.get_input_embeddings().weight) - before).abs().max())
        report[str(engine.data_parallel_mode)] = dict(
            sparse_by_default=sparse_by_default,
            same_names=sorted(sparse) == sorted(dense),
            tied_diff=float((sparse[tied[0]] - dense[tied[0]]).abs().max()),
            tied_scale=float(dense[tied[0]].abs().max()),
            others_equal=all(torch.equal(sparse[n], dense[n]) for n in dense if n != tied[0]),
            moved=moved,
        )
    untied = TrainEngine(EngineConfig(model_path=untied_dir, device="cpu"))
    report["untied_sparse"] = bool(untied.model.get_input_embeddings().sparse)
    if rank == 0:
        with open(os.path.join(root, "report.json"), "w") as f:
            json.dump(report, f)


def test_tied_embedding_sparse_lookup_gives_the_dense_gradient(tmp_path):
    tied = build_tiny_causal_lm(str(tmp_path / "tied"), seed=3, tie_word_embeddings=True)
    untied = build_tiny_causal_lm(str(tmp_path / "untied"), seed=3, tie_word_embeddings=False)
    spawn_ranks(_worker, 2, args=(str(tmp_path), tied, untied), timeout_s=240)
    with open(tmp_path / "report.json") as f:
        report = json.load(f)
    assert report.pop("untied_sparse") is False
    assert sorted(report) == ["ddp", "fsdp"]
    for mode, r in report.items():
        assert r["sparse_by_default"], mode
        assert r["same_names"] and r["others_equal"], (mode, r)
        assert r["tied_scale"] > 0 and r["tied_diff"] <= 1e-6 * r["tied_scale"], (mode, r)
        assert r["moved"] > 0, (mode, r)
