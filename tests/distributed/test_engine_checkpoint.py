"""Optimizer steps, non-finite-step skipping, sharded checkpoint round trip and HF export on a
dp=2 mesh (2 CPU processes, one launch).

Round trip: after save -> load into a fresh engine, parameters, optimizer moments, schedule and
counters are back, shown by the next step producing bit-identical parameters to the step taken by
the original engine; loaded into whole replicas (`fsdp_size=1`, DDP), the same step within 1e-6, a
non-finite gradient on one replica makes both replicas skip, and the replicas' own checkpoint loads
back into a fully sharded engine unchanged; replicas export a loadable HF directory as shards do.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import transformers

from ballast.engine import EngineConfig, MicroBatchSpec, OptimConfig, TrainEngine, agg_loss
from testkit.engine import full, local, make_rl_batch, spawn_ranks

# Progress bars start tqdm's monitor thread; without it the ranks can be forked (fast).
transformers.utils.logging.disable_progress_bar()

SPEC = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=96)
OPTIM = OptimConfig(lr=1e-2, lr_schedule="cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)


def loss_fn(outputs, micro, norm):
    loss_mat = -micro["advantages"] * outputs["log_probs"]
    return agg_loss(loss_mat, micro["response_mask"], "seq-mean-token-mean", norm), {}


def _full_params(engine):
    return {n: full(p).detach().clone() for n, p in engine.model.named_parameters()}


def _moments(engine):
    return [
        (full(s["exp_avg"]).clone(), full(s["exp_avg_sq"]).clone())
        for s in engine.optimizer.state.values()
    ]


def _step(engine, data):
    engine.forward_backward_batch(data, loss_fn, engine.plan_micro_batches(data, SPEC))
    return engine.optimizer_step()


def _checkpoint_worker(rank, world, root, model_dir):
    from tensordict import TensorDict

    from ballast.engine.dist import build_parallel_state

    data = TensorDict(torch.load(os.path.join(root, "data.pt"), weights_only=True), batch_size=[8])
    rows = data[rank * 4 : (rank + 1) * 4]
    parallel = build_parallel_state(1, "cpu")
    cfg = EngineConfig(model_path=model_dir, optim=OPTIM, grad_clip=1.0)
    engine = TrainEngine(cfg, parallel=parallel)
    report = {"lrs": []}
    first = _step(engine, rows)
    report["lrs"].append(first["lr"])
    report["first_grad_norm"] = first["grad_norm"]

    # a non-finite gradient on ONE rank's shard: every rank must skip the step
    engine.forward_backward_batch(rows, loss_fn, engine.plan_micro_batches(rows, SPEC))
    before, moments_before = _full_params(engine), _moments(engine)
    if rank == 0:
        local(next(p for p in engine.model.parameters() if p.grad is not None).grad).view(-1)[0] = float("nan")
    skipped = engine.optimizer_step()
    report["skipped"] = skipped
    after, moments_after = _full_params(engine), _moments(engine)
    report["params_unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
    report["moments_unchanged"] = all(
        torch.equal(a0, a1) and torch.equal(b0, b1) for (a0, b0), (a1, b1) in zip(moments_before, moments_after)
    )
    report["grads_cleared"] = all(p.grad is None for p in engine.model.parameters())

    second = _step(engine, rows)
    report["lrs"].append(second["lr"])
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    saved = _full_params(engine)
    third = _step(engine, rows)
    report["lrs"].append(third["lr"])
    expected = _full_params(engine)

    fresh = TrainEngine(cfg, parallel=parallel)
    report["fresh_differs"] = any(not torch.equal(saved[n], p) for n, p in _full_params(fresh).items())
    fresh.load_checkpoint(os.path.join(root, "ckpt"))
    loaded = _full_params(fresh)
    report["loaded_equal"] = all(torch.equal(saved[n], loaded[n]) for n in saved)
    report["counters"] = (fresh.global_step, fresh.skipped_steps)
    third_again = _step(fresh, rows)
    report["third_lr"] = (third["lr"], third_again["lr"])
    got = _full_params(fresh)
    report["resumed_step_max_diff"] = max(float((got[n] - expected[n]).abs().max()) for n in got)

    # the same checkpoint resumed with hybrid sharding (a whole replica per rank): DCP reshards it
    import dataclasses

    hybrid = TrainEngine(dataclasses.replace(cfg, fsdp_size=1), parallel=build_parallel_state(1, "cpu", 1))
    report["hybrid_mode"] = hybrid.data_parallel_mode
    hybrid.load_checkpoint(os.path.join(root, "ckpt"))
    _step(hybrid, rows)
    got = _full_params(hybrid)
    report["hybrid_resumed_step_max_diff"] = max(float((got[n] - expected[n]).abs().max()) for n in got)
    # a non-finite gradient on one replica only: both replicas skip, so they stay equal
    hybrid.forward_backward_batch(rows, loss_fn, hybrid.plan_micro_batches(rows, SPEC))
    if rank == 0:
        local(next(p for p in hybrid.model.parameters() if p.grad is not None).grad).view(-1)[0] = float("nan")
    report["hybrid_skipped"] = hybrid.optimizer_step()["step_skipped"]
    mine = torch.cat([local(p).reshape(-1) for p in hybrid.model.parameters()])
    replicas = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(replicas, mine)
    report["hybrid_replicas_equal"] = all(torch.equal(r, mine) for r in replicas)
    # and back: the replicas' checkpoint resumes a fully sharded engine with the same weights and moments
    hybrid.save_checkpoint(os.path.join(root, "ckpt_replicas"))
    hybrid.export_hf(os.path.join(root, "export_replicas"))
    replica_state = {name: tensor.clone() for name, tensor in hybrid.iter_full_state_dict()}
    if rank == 0:
        torch.save(replica_state, os.path.join(root, "replica_state.pt"))
    sharded = TrainEngine(cfg, parallel=parallel)
    sharded.load_checkpoint(os.path.join(root, "ckpt_replicas"))
    report["replicas_to_sharded_equal"] = (
        all(torch.equal(a, b) for a, b in zip(_full_params(hybrid).values(), _full_params(sharded).values()))
        and all(torch.equal(a0, a1) and torch.equal(b0, b1)
                for (a0, b0), (a1, b1) in zip(_moments(hybrid), _moments(sharded)))
        and (sharded.global_step, sharded.skipped_steps) == (hybrid.global_step, hybrid.skipped_steps)
    )

    fresh.export_hf(os.path.join(root, "export"))
    names = [name for name, _ in fresh.iter_full_state_dict()]
    all_names = [None] * world
    dist.all_gather_object(all_names, names)
    report["same_order_on_all_ranks"] = all(n == names for n in all_names)
    full = dict(fresh.iter_full_state_dict())
    if rank == 0:
        torch.save(full, os.path.join(root, "full_state.pt"))
        with open(os.path.join(root, "report.json"), "w") as f:
            json.dump(report, f)


@pytest.fixture(scope="module")
def model_dir():
    from ballast.models import tiny_model_dir

    return str(tiny_model_dir("tiny"))


def test_steps_skip_checkpoint_and_export(tmp_path, model_dir):
    data = make_rl_batch([4, 9, 2, 15, 7, 3, 11, 5], [20, 3, 40, 12, 30, 8, 25, 16], vocab_size=500, seed=2)
    torch.save(data.to_dict(), tmp_path / "data.pt")
    spawn_ranks(_checkpoint_worker, 2, args=(str(tmp_path), model_dir), timeout_s=180)
    rep = json.loads((tmp_path / "report.json").read_text())

    # warmup (s + 1) / 2 for s = 0, 1, then the cosine starts at 1; the skipped step does not advance it
    assert rep["lrs"] == pytest.approx([0.5e-2, 1e-2, 1e-2])
    assert rep["first_grad_norm"] > 0
    assert rep["skipped"]["step_skipped"] == 1.0 and rep["skipped"]["skipped_steps"] == 1.0
    assert rep["skipped"]["global_step"] == 1.0
    assert rep["params_unchanged"] and rep["moments_unchanged"] and rep["grads_cleared"]

    assert rep["fresh_differs"], "a fresh engine already equals the trained one: the round trip proves nothing"
    assert rep["loaded_equal"]
    assert rep["counters"] == [2, 1]
    assert rep["third_lr"][0] == rep["third_lr"][1]
    assert rep["resumed_step_max_diff"] == 0.0
    assert rep["hybrid_resumed_step_max_diff"] < 1e-6  # only the grad-norm reduction order differs
    assert rep["hybrid_mode"] == "ddp"
    assert rep["hybrid_skipped"] == 1.0 and rep["hybrid_replicas_equal"]
    assert rep["replicas_to_sharded_equal"]
    assert rep["same_order_on_all_ranks"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = tmp_path / "export"
    config = json.loads((export / "config.json").read_text())
    assert "ballast" not in json.dumps(config), "the export must load without ballast's attention registered"
    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    full = torch.load(tmp_path / "full_state.pt", weights_only=True)
    hf_state = hf.state_dict()
    for name, tensor in full.items():
        assert torch.equal(hf_state[name], tensor), name
    # the tiny model ties lm_head to the embedding: the weight sync sends it under both names (vLLM's
    # CPU reload re-packs the head only when its own name arrives)
    assert hf.config.tie_word_embeddings and torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])
    # the replicas (DDP) export the same way: an HF directory holding exactly their weights
    replicas = AutoModelForCausalLM.from_pretrained(tmp_path / "export_replicas", dtype=torch.float32).state_dict()
    replica_state = torch.load(tmp_path / "replica_state.pt", weights_only=True)
    assert replica_state.keys() == full.keys()
    assert all(torch.equal(replicas[name], tensor) for name, tensor in replica_state.items())
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.decode(tokenizer.encode("1 + 2 = 3")).strip() == "1 + 2 = 3"
