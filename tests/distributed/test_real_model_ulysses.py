"""Ulysses and the HF export on the real pretrained model: SmolLM2-135M has 9 attention heads and 3 KV heads, so sp=3
splits both evenly (3 query heads, 1 KV head per rank). On a (dp=1, sp=3) mesh of 3 CPU processes
the engine's log-probs, loss and gradient equal a single-process plain-HF reference; sp=2 is a
start-up error naming both head counts (tests/e2e/test_real_model.py). The same launch exports the
sharded model to a HF directory, which must load and compute what the source does.

The model here is the pretrained one cut to its first LAYERS decoder layers (their real weights, the
real embeddings, tied head, tokenizer and chat files): every layer has the same head layout, which is
what the sequence-parallel split acts on, and three processes loading all 30 layers cost ~70 s of the
suite's CPU. The whole 30-layer model runs end to end in tests/e2e/test_real_model.py."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import transformers

from ballast.engine import EngineConfig, GlobalNorm, MicroBatchSpec, TrainEngine, agg_loss
from testkit.engine import make_rl_batch, reference_log_probs, spawn_ranks

transformers.utils.logging.disable_progress_bar()

PROMPTS, RESPONSES = [9, 14], [11, 5]
LAYERS = 4


def token_mean_loss(outputs, micro, norm):
    return agg_loss(-micro["advantages"] * outputs["log_probs"], micro["response_mask"], "token-mean", norm), {}


@pytest.fixture(scope="module")
def problem(smollm2_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("real_ulysses")
    model_dir = root / "smollm2_first_layers"
    cut = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, num_hidden_layers=LAYERS)
    cut.save_pretrained(model_dir)
    for name in os.listdir(smollm2_dir):  # tokenizer, chat template, generation config
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(smollm2_dir, name), model_dir / name)
    data = make_rl_batch(PROMPTS, RESPONSES, vocab_size=49152, seed=5)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    assert model.config.num_hidden_layers == LAYERS and model.config.num_attention_heads == 9
    lp, _ = reference_log_probs(model, data, 1.0)
    loss, _ = token_mean_loss({"log_probs": lp}, data, GlobalNorm.local(data["response_mask"]))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.save({"data": data.to_dict(), "log_probs": lp.detach(), "loss": float(loss.detach()), "grads": grads},
               root / "ref.pt")
    return str(root), str(model_dir)


def _sp3_worker(rank, world, root, model_dir):
    from tensordict import TensorDict

    from ballast.engine.dist import build_parallel_state

    ref = torch.load(os.path.join(root, "ref.pt"), weights_only=True)
    data = TensorDict(ref["data"], batch_size=[len(PROMPTS)])
    parallel = build_parallel_state(3, "cpu")
    engine = TrainEngine(EngineConfig(model_path=model_dir, ulysses_sequence_parallel_size=3), parallel=parallel)
    spec = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=32)
    out = engine.infer_batch(data, engine.plan_micro_batches(data, spec))
    metrics = engine.forward_backward_batch(data, token_mean_loss, engine.plan_micro_batches(data, spec))
    grads = {n: p.grad.full_tensor() for n, p in engine.model.named_parameters()}
    # tied embeddings: lm_head shares embed_tokens, so the reference has one gradient for both
    names = sorted(set(grads) & set(ref["grads"]))
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in ref["grads"].values()))
    report = {
        "log_probs": float((out["log_probs"] - ref["log_probs"]).abs().max()),
        "loss": (metrics["loss"], ref["loss"]),
        "grad": max(float((grads[n] - ref["grads"][n]).abs().max()) for n in names) / norm,
        "num_compared": len(names), "num_ref": len(ref["grads"]),
        "sp_world": dist.get_world_size(parallel.sp_group),
    }
    engine.export_hf(os.path.join(root, "export"))  # collective; no optimizer step ran, so weights are the source's
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        torch.save(gathered, os.path.join(root, "report.pt"))


@pytest.mark.slow
def test_ulysses_sp3_on_the_real_model_equals_the_single_process_reference_and_exports(problem):
    root, model_dir = problem
    spawn_ranks(_sp3_worker, 3, args=(root, model_dir), timeout_s=300)
    reports = torch.load(os.path.join(root, "report.pt"), weights_only=True)
    for rank, rep in enumerate(reports):
        assert rep["num_compared"] == rep["num_ref"] and rep["sp_world"] == 3, rep
        assert rep["log_probs"] < 1e-4, (rank, rep)
        loss, ref = rep["loss"]
        assert loss == pytest.approx(ref, rel=1e-5, abs=1e-6), (rank, rep)
        assert rep["grad"] < 1e-5, (rank, rep)
    # the HF export of the FSDP-sharded real model: tied embeddings stored once, chat files copied,
    # and it computes what the source directory computes
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = os.path.join(root, "export")
    with safe_open(os.path.join(export, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    assert {"chat_template.jinja", "tokenizer.json", "generation_config.json"} <= set(os.listdir(export))
    assert AutoTokenizer.from_pretrained(export).eos_token == "<|im_end|>"
    ids = torch.tensor([[1, 4093, 198, 1203, 314, 216, 34, 1232, 216, 34, 47, 2]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(export).eval()(input_ids=ids).logits
        want = AutoModelForCausalLM.from_pretrained(model_dir).eval()(input_ids=ids).logits
    assert got.shape == want.shape and float((got - want).abs().max()) < 1e-4
