"""`fsdp_size=1` as the trainer runs it on CUDA, simulated on 2 CPU ranks.

On CUDA the trainer always computes in bf16 (precision "auto"), and DDP replicas are an fp32-only path
(`ballast.engine.parallelize.whole_replicas`): there `fsdp_size=1` is FSDP2 over a (replicate=world,
shard=1) mesh, each rank a whole copy, gradients reduced across the copies. The fp32 CPU tests take the
DDP path instead, so this layout is forced here with `precision="bf16"` on gloo and checked against the
fully sharded engine on the same bf16 compute: the layout, the loss and gradients, one AdamW step, the
replicas staying identical, the weight-sync gather, and a checkpoint round trip into the sharded engine.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist
import transformers

from ballast.engine import EngineConfig, MicroBatchSpec, OptimConfig, TrainEngine, agg_loss
from testkit.engine import full, local, make_rl_batch, spawn_ranks

transformers.utils.logging.disable_progress_bar()

SPEC = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=64)


def loss_fn(outputs, micro, norm):
    loss_mat = -micro["advantages"] * outputs["log_probs"]
    return agg_loss(loss_mat, micro["response_mask"], "token-mean", norm), {}


def _full_params(engine):
    return {n: full(p).detach().float().clone() for n, p in engine.model.named_parameters()}


def _max_diff(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _worker(rank, world, root, model_dir):
    from tensordict import TensorDict

    from ballast.engine.dist import build_parallel_state

    data = TensorDict(torch.load(os.path.join(root, "data.pt"), weights_only=True), batch_size=[8])
    rows = data[rank * 4:(rank + 1) * 4]
    cfg = EngineConfig(model_path=model_dir, precision="bf16", optim=OptimConfig(lr=1e-2), grad_clip=1.0)
    sharded = TrainEngine(cfg, parallel=build_parallel_state(1, "cpu"))
    replicas = TrainEngine(dataclasses.replace(cfg, fsdp_size=1), parallel=build_parallel_state(1, "cpu", 1))
    report = {"modes": [sharded.data_parallel_mode, replicas.data_parallel_mode],
              "mesh": list(replicas.parallel.param_mesh.shape)}
    report["initial_diff"] = _max_diff(_full_params(sharded), _full_params(replicas))

    losses, grads = [], []
    for engine in (sharded, replicas):
        losses.append(engine.forward_backward_batch(rows, loss_fn, engine.plan_micro_batches(rows, SPEC))["loss"])
        grads.append({n: full(p.grad).float().clone() for n, p in engine.model.named_parameters()})
    report["losses"] = losses
    report["grad_norm_ref"] = max(float(g.abs().max()) for g in grads[0].values())
    report["grad_diff"] = _max_diff(grads[0], grads[1])
    steps = [engine.optimizer_step() for engine in (sharded, replicas)]
    report["grad_norms"] = [s["grad_norm"] for s in steps]
    after = [_full_params(sharded), _full_params(replicas)]
    report["moved"] = max(float((after[0][n] - p).abs().max()) for n, p in _full_params(
        TrainEngine(cfg, parallel=build_parallel_state(1, "cpu"))).items())
    report["param_diff"] = _max_diff(after[0], after[1])

    mine = torch.cat([local(p).detach().reshape(-1) for p in replicas.model.parameters()])
    copies = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(copies, mine)
    report["replicas_equal"] = all(torch.equal(c, mine) for c in copies)
    synced = dict(replicas.iter_full_state_dict())  # what the weight sync sends to the rollout engine
    expected = dict(sharded.iter_full_state_dict())
    report["sync_names_equal"] = list(synced) == list(expected)
    report["sync_diff"] = max(float((synced[n].float() - expected[n].float()).abs().max()) for n in expected)

    replicas.save_checkpoint(os.path.join(root, "ckpt"))
    resumed = TrainEngine(cfg, parallel=build_parallel_state(1, "cpu"))
    resumed.load_checkpoint(os.path.join(root, "ckpt"))
    report["resumed_equal"] = all(torch.equal(a, b) for a, b in zip(_full_params(replicas).values(),
                                                                     _full_params(resumed).values()))
    if rank == 0:
        with open(os.path.join(root, "report.json"), "w") as f:
            json.dump(report, f)


def test_fsdp_size_1_under_bf16_is_fsdp2_replicas_equal_to_the_sharded_engine(tmp_path):
    from ballast.models import tiny_model_dir

    data = make_rl_batch([4, 9, 2, 15, 7, 3, 11, 5], [20, 3, 40, 12, 30, 8, 25, 16], vocab_size=500, seed=3)
    torch.save(data.to_dict(), tmp_path / "data.pt")
    spawn_ranks(_worker, 2, args=(str(tmp_path), str(tiny_model_dir("tiny"))), timeout_s=300)
    rep = json.loads((tmp_path / "report.json").read_text())

    assert rep["modes"] == ["fsdp", "fsdp"] and rep["mesh"] == [2, 1]  # not DDP: bf16 keeps FSDP2
    assert rep["initial_diff"] == 0.0
    # the same bf16 compute on the same rows; only the cross-rank reduction differs (an fp32 sum of two)
    assert abs(rep["losses"][0] - rep["losses"][1]) <= 1e-6 * max(1.0, abs(rep["losses"][0]))
    assert rep["grad_diff"] <= 1e-6 * rep["grad_norm_ref"], rep
    assert abs(rep["grad_norms"][0] - rep["grad_norms"][1]) <= 1e-5 * rep["grad_norms"][0]
    assert rep["moved"] > 1e-4, "the step did not change the parameters: the comparison proves nothing"
    assert rep["param_diff"] <= 1e-6, rep
    assert rep["replicas_equal"]
    assert rep["sync_names_equal"] and rep["sync_diff"] <= 1e-6
    assert rep["resumed_equal"]
