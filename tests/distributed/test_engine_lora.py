"""A LoRA engine on 2 CPU ranks, fully sharded (FSDP2) and as whole replicas (DDP): the optimizer holds
the adapter only and the base never moves; the adapter-only checkpoint resumes bit-identically and
refuses an engine without the adapter; the export's merged weights and PEFT adapter reproduce the
engine's log-probs; the adapter switched off is the base model (the reference policy); the layered
and bucketed gathers of a weight sync agree."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist
import transformers

from ballast.engine import EngineConfig, MicroBatchSpec, OptimConfig, TrainEngine, agg_loss
from ballast.engine.config import LoraSpec
from testkit.engine import full, make_rl_batch, reference_log_probs, spawn_ranks

transformers.utils.logging.disable_progress_bar()

SPEC = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=96)
PROBE = [5, 77, 13, 250, 9, 31, 4, 120, 66, 2, 18]
LORA = LoraSpec(rank=4, alpha=8, exclude_modules=["down_proj"])


def loss_fn(outputs, micro, norm):
    return agg_loss(-micro["advantages"] * outputs["log_probs"], micro["response_mask"], "token-mean", norm), {}


def _step(engine, data):
    engine.forward_backward_batch(data, loss_fn, engine.plan_micro_batches(data, SPEC))
    return engine.optimizer_step()


def _params(engine, trainable):
    return {n: full(p).detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad == trainable}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _lora_worker(rank, world, root, model_dir, fsdp_size):
    from tensordict import TensorDict

    from ballast.engine.dist import build_parallel_state

    tag = "ddp" if fsdp_size == 1 else "fsdp"
    data = TensorDict(torch.load(os.path.join(root, "data.pt"), weights_only=True), batch_size=[8])
    rows = data[rank * 4:(rank + 1) * 4]
    parallel = build_parallel_state(1, "cpu", fsdp_size)
    cfg = EngineConfig(model_path=model_dir, optim=OptimConfig(lr=5e-2), fsdp_size=fsdp_size, lora=LORA)
    engine = TrainEngine(cfg, parallel=parallel)
    report = {"mode": str(engine.data_parallel_mode)}
    optimized = [p for group in engine.optimizer.param_groups for p in group["params"]]
    trainable = [p for p in engine.model.parameters() if p.requires_grad]
    report["optimizer_is_the_adapter"] = (len(optimized) == len(trainable) > 0
                                          and {id(p) for p in optimized} == {id(p) for p in trainable})
    report["adapter_numel"] = sum(p.numel() for p in trainable)
    frozen_before = _params(engine, False)
    _step(engine, rows)
    report["base_unchanged"] = _same(frozen_before, _params(engine, False))

    engine.save_checkpoint(os.path.join(root, f"ckpt_{tag}"))
    saved = _params(engine, True)
    _step(engine, rows)
    expected = _params(engine, True)
    fresh = TrainEngine(cfg, parallel=parallel)
    fresh.load_checkpoint(os.path.join(root, f"ckpt_{tag}"))
    report["loaded_equal"] = _same(saved, _params(fresh, True))
    _step(fresh, rows)
    report["resumed_step_equal"] = _same(expected, _params(fresh, True))
    plain = TrainEngine(dataclasses.replace(cfg, lora=LoraSpec()), parallel=parallel)
    try:
        plain.load_checkpoint(os.path.join(root, f"ckpt_{tag}"))
        report["full_engine_refused"] = ""
    except ValueError as err:
        report["full_engine_refused"] = str(err)

    # the reference policy: the actor with its adapter switched off equals the base model
    plan = engine.plan_micro_batches(rows, SPEC)
    adapted = engine.infer_batch(rows, plan)["log_probs"]
    with engine.adapter_disabled():
        base = engine.infer_batch(rows, plan)["log_probs"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected_base, _ = reference_log_probs(hf, rows)
    mask = rows["response_mask"].bool()
    report["ref_max_diff"] = float((base - expected_base)[mask].abs().max())
    report["adapter_effect"] = float((adapted - base)[mask].abs().max())

    # weight sync views: layered and bucketed gathers give the same tensors in the same order
    bucketed = [(n, t.clone()) for n, t in engine.iter_adapter_state_dict()]
    layered = [(n, t.clone()) for n, t in engine.iter_adapter_state_dict(layered=True)]
    report["layered_equal"] = ([n for n, _ in bucketed] == [n for n, _ in layered]
                               and all(torch.equal(a, b) for (_, a), (_, b) in zip(bucketed, layered)))
    merged = dict(engine.iter_full_state_dict(layered=True))
    report["merged_names_are_hf"] = all(".lora_" not in n and "base_layer" not in n for n in merged)
    probe = engine.probe_log_probs(PROBE)
    engine.export_hf(os.path.join(root, f"export_{tag}"))
    if rank == 0:
        torch.save({"probe": probe, "merged": merged}, os.path.join(root, f"state_{tag}.pt"))
        with open(os.path.join(root, f"report_{tag}.json"), "w") as f:
            json.dump(report, f)
    dist.barrier()


@pytest.fixture(scope="module")
def model_dir():
    from ballast.models import tiny_model_dir

    return str(tiny_model_dir("tiny"))


def _probe_log_probs(model):
    ids = torch.tensor([PROBE])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]


@pytest.mark.parametrize("fsdp_size", [-1, 1], ids=["fsdp2", "ddp"])
def test_lora_engine_trains_checkpoints_and_exports_the_adapter(tmp_path, model_dir, fsdp_size):
    from peft import PeftModel
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    tag = "ddp" if fsdp_size == 1 else "fsdp"
    data = make_rl_batch([4, 9, 2, 15, 7, 3, 11, 5], [20, 3, 40, 12, 30, 8, 25, 16], vocab_size=500, seed=2)
    torch.save(data.to_dict(), tmp_path / "data.pt")
    spawn_ranks(_lora_worker, 2, args=(str(tmp_path), model_dir, fsdp_size), timeout_s=240)
    rep = json.loads((tmp_path / f"report_{tag}.json").read_text())
    assert rep["mode"] == tag
    assert rep["optimizer_is_the_adapter"] and rep["base_unchanged"]
    assert rep["loaded_equal"] and rep["resumed_step_equal"]
    assert "saved with LoRA adapter (rank 4" in rep["full_engine_refused"]
    assert rep["ref_max_diff"] < 1e-5 < 1e-2 < rep["adapter_effect"]
    assert rep["layered_equal"] and rep["merged_names_are_hf"]

    # the checkpoint holds the adapter and its optimizer state, not the frozen base weights
    keys = FileSystemReader(str(tmp_path / f"ckpt_{tag}" / "dcp")).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert not any("embed_tokens" in k for k in keys)

    state = torch.load(tmp_path / f"state_{tag}.pt", weights_only=True)
    export = tmp_path / f"export_{tag}"
    merged = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert all(torch.equal(merged.state_dict()[n], t) for n, t in state["merged"].items())
    assert torch.allclose(_probe_log_probs(merged), state["probe"], atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(export / "lora_adapter"))
    assert torch.allclose(_probe_log_probs(with_adapter), state["probe"], atol=1e-5)
    assert json.loads((export / "lora_adapter" / "adapter_config.json").read_text())["r"] == 4
