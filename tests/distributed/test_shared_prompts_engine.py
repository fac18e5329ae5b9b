"""Shared prompts on two gloo ranks: the loss, the full gradient and the inferred log-probs of one
mini-batch equal the single-process reference (each sample alone, unpadded, plain transformers model)
when the driver's plan runs each prompt once, under FSDP2, under DDP (whole replicas) and for a LoRA
adapter, on static and token-budget cuts; and the shared plan feeds fewer tokens than the rows hold.

Tolerance as the invariance matrix (fp32): |loss - ref| <= 1e-5 * max(1, |ref|), max_i |grad_i - ref_i|
<= 1e-5 * ||ref grad||_2, log-probs within 2e-5.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import transformers

from ballast.balance import MicroBatchPolicy, plan_phase
from ballast.engine import EngineConfig, TrainEngine
from ballast.engine.config import LoraSpec
from ballast.engine.losses import agg_loss
from testkit.engine import full, make_rl_batch, reference_log_probs, spawn_ranks
from testkit.models import build_tiny_causal_lm

transformers.utils.logging.disable_progress_bar()

NUM_PROMPTS, N = 6, 4
TEMPERATURE = 0.9
REL_TOL = 1e-5
# (name, fsdp_size, LoRA, micro-batch policy)
RUNS = [("fsdp2-dynamic", -1, False, MicroBatchPolicy("dynamic", token_budget=160)),
        ("ddp-static", 1, False, MicroBatchPolicy("static", micro_batch_size=4)),
        ("lora-dynamic", -1, True, MicroBatchPolicy("dynamic", token_budget=160))]


def _grouped_batch():
    """6 prompts of 4-30 tokens x 4 responses of 0-30 tokens; a prompt's rows scattered over the batch."""
    rng = np.random.default_rng(21)
    prompt_of = rng.permutation(np.repeat(np.arange(NUM_PROMPTS), N))
    prompt_lens = rng.integers(4, 31, NUM_PROMPTS)
    responses = rng.integers(0, 31, len(prompt_of))
    responses[0] = 0
    data = make_rl_batch(prompt_lens[prompt_of].tolist(), responses.tolist(), vocab_size=128, seed=22)
    width = data["input_ids"].shape[1] - data["responses"].shape[1]
    for p in range(NUM_PROMPTS):
        rows = np.flatnonzero(prompt_of == p)
        data["input_ids"][torch.as_tensor(rows), :width] = data["input_ids"][int(rows[0]), :width]
    return data, prompt_of


def _loss(outputs, micro, norm):
    return agg_loss(-micro["advantages"] * outputs["log_probs"], micro["response_mask"], "token-mean", norm), {}


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from ballast.engine.lora import attach_adapter, save_adapter

    root = tmp_path_factory.mktemp("shared")
    model_dir = build_tiny_causal_lm(str(root / "model"), seed=7, tie_word_embeddings=True)
    data, prompt_of = _grouped_batch()
    torch.save(data.to_dict(), root / "data.pt")
    np.save(root / "prompt_of.npy", prompt_of)
    refs = {}
    for lora in (False, True):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        if lora:
            adapter = attach_adapter(model, LoraSpec(rank=4, alpha=8), "actor", seed=5)
            with torch.no_grad():  # B != 0, so that A has a gradient
                for name, p in model.named_parameters():
                    if ".lora_B." in name:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(6)) * 0.1)
            save_adapter(str(root / "adapter"), model.state_dict().items(), adapter)
        lp, _ = reference_log_probs(model, data, TEMPERATURE)
        mask = data["response_mask"].float()
        loss = (-data["advantages"] * lp * mask).sum() / mask.sum()
        loss.backward()
        refs[lora] = (float(loss.detach()), lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    torch.save(refs, root / "refs.pt")
    return str(root), model_dir


def _worker(rank, world, root, model_dir):
    from tensordict import TensorDict

    from ballast.engine.dist import build_parallel_state

    data = TensorDict(torch.load(os.path.join(root, "data.pt"), weights_only=True), batch_size=[NUM_PROMPTS * N])
    prompt_of = np.load(os.path.join(root, "prompt_of.npy"))
    refs = torch.load(os.path.join(root, "refs.pt"), weights_only=True)
    lengths = data["attention_mask"].sum(-1).numpy()
    width = data["input_ids"].shape[1] - data["responses"].shape[1]
    prompt_lengths = data["attention_mask"][:, :width].sum(-1).numpy()
    results = []
    for name, fsdp_size, lora, policy in RUNS:
        plan = plan_phase(lengths, world, policy, shared_prompts=prompt_of, prompt_lengths=prompt_lengths)
        rows = torch.as_tensor(plan.rank_rows(rank))
        cfg = EngineConfig(model_path=model_dir, fsdp_size=fsdp_size, reshard_after_forward=fsdp_size != 1,
                           lora=LoraSpec(adapter_path=os.path.join(root, "adapter")) if lora else LoraSpec())
        engine = TrainEngine(cfg, parallel=build_parallel_state(1, "cpu", fsdp_size))
        metrics = engine.forward_backward_batch(data[rows], _loss, plan.mini_batches[0], temperature=TEMPERATURE)
        grads = {n: full(p.grad) for n, p in engine.model.named_parameters() if p.requires_grad}
        ref_loss, ref_lp, ref_grads = refs[lora]
        inferred = engine.infer_batch(data[rows], plan.mini_batches[0], temperature=TEMPERATURE)["log_probs"]
        results.append(dict(
            name=name, data_parallel=engine.data_parallel_mode, loss=metrics["loss"], ref_loss=ref_loss,
            grad_keys=sorted(grads) == sorted(ref_grads),
            max_grad_diff=max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads),
            ref_grad_norm=math.sqrt(sum(float((g.double() ** 2).sum()) for g in ref_grads.values())),
            max_log_prob_diff=float((inferred - ref_lp[rows]).abs().max()),
            executed=[int(t) for rank_tokens in engine.last_micro_batch_tokens for t in rank_tokens],
            row_tokens=int(lengths.sum()), num_micro_batches=metrics["num_micro_batches"],
        ))
    if rank == 0:
        with open(os.path.join(root, "results.json"), "w") as f:
            json.dump(results, f)


def test_shared_prompt_plans_give_the_reference_loss_gradient_and_log_probs(problem):
    root, model_dir = problem
    spawn_ranks(_worker, 2, args=(root, model_dir), timeout_s=240)
    with open(os.path.join(root, "results.json")) as f:
        results = json.load(f)
    assert [r["name"] for r in results] == [name for name, *_ in RUNS]
    assert [r["data_parallel"] for r in results] == ["fsdp", "ddp", "fsdp"]
    for r in results:
        assert r["grad_keys"], r["name"]
        assert abs(r["loss"] - r["ref_loss"]) <= REL_TOL * max(1.0, abs(r["ref_loss"])), r
        assert r["max_grad_diff"] <= REL_TOL * r["ref_grad_norm"], r
        assert r["max_log_prob_diff"] <= 2e-5, r
        assert sum(r["executed"]) < 0.8 * r["row_tokens"], r  # each prompt ran once, not four times
        assert r["num_micro_batches"] >= 2, r  # a real cut: several micro-batches per rank
