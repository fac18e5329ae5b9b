"""GPU-only engine paths: NCCL, bf16 mixed precision, flash-attention varlen, shared-prompt attention,
CPU offload.

Marked `gpu` (run by scripts/gpu_smoke.sh on a CUDA machine, skipped elsewhere). bf16 results are
compared with the fp32 CPU reference at bf16 tolerance; the exact invariance matrix is the fp32
CPU suite's job.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from ballast.engine import EngineConfig, MicroBatchSpec, TrainEngine, agg_loss
from ballast.engine.attention import flash_attn_varlen, varlen_causal_attention
from testkit.engine import make_rl_batch, reference_log_probs, spawn_ranks
from testkit.models import build_tiny_causal_lm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_flash_varlen_matches_per_sequence_sdpa():
    if flash_attn_varlen() is None:
        pytest.skip("flash-attn is not installed")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 300, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, 17, 150, 151, 290], dtype=torch.int32, device="cuda")
    flash = varlen_causal_attention(q, k, v, cu, max_seqlen=139, scaling=0.125, backend="flash")
    loop = varlen_causal_attention(q, k, v, cu, max_seqlen=139, scaling=0.125, backend="sdpa")
    torch.testing.assert_close(flash.float(), loop.float(), atol=2e-2, rtol=2e-2)
    assert torch.all(flash[:, 290:] == 0)


def test_shared_prefix_attention_on_cuda_in_bf16_matches_fp32_on_cpu():
    from ballast.engine.shared_prefix import SharedGroup, shared_prefix_attention

    groups = (SharedGroup(0, 40, (30, 0, 25)), SharedGroup(95, 12, (50, 7)))  # 164 tokens, then 4 of padding
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 168, 64, generator=gen) for h in (8, 2, 2))
    ref = shared_prefix_attention(q, k, v, groups, scaling=0.125)
    q_gpu, k_gpu, v_gpu = (t.to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v))
    out = shared_prefix_attention(q_gpu, k_gpu, v_gpu, groups, scaling=0.125)
    torch.testing.assert_close(out.float().cpu(), ref, atol=3e-2, rtol=3e-2)
    out.float().pow(2).sum().backward()
    assert all(torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in (q_gpu, k_gpu, v_gpu))


def _loss(outputs, micro, norm):
    return agg_loss(-micro["advantages"] * outputs["log_probs"], micro["response_mask"], "token-mean", norm), {}


def _gpu_worker(rank, world, root, model_dir, offload):
    from tensordict import TensorDict

    from ballast.engine.dist import build_parallel_state

    sp = world
    data = TensorDict(torch.load(os.path.join(root, "data.pt"), weights_only=True), batch_size=[6])
    parallel = build_parallel_state(sp, "cuda")
    cfg = EngineConfig(model_path=model_dir, device="cuda", cpu_offload=offload, ulysses_sequence_parallel_size=sp)
    engine = TrainEngine(cfg, parallel=parallel)
    spec = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=64)
    out = engine.infer_batch(data, engine.plan_micro_batches(data, spec), calculate_entropy=True)
    ref = torch.load(os.path.join(root, "ref.pt"), weights_only=True)
    before = {n: p.full_tensor().float().cpu() for n, p in engine.model.named_parameters()}
    metrics = engine.forward_backward_batch(data, _loss, engine.plan_micro_batches(data, spec))
    step = engine.optimizer_step()
    after = {n: p.full_tensor().float().cpu() for n, p in engine.model.named_parameters()}
    report = dict(
        log_prob_max_diff=float((out["log_probs"].float().cpu() - ref).abs().max()),
        loss=metrics["loss"],
        grad_norm=step["grad_norm"],
        params_moved=sum(int(not torch.equal(before[n], after[n])) for n in before),
        param_devices=sorted({p.to_local().device.type for p in engine.model.parameters()}),
        param_dtype=str(next(engine.model.parameters()).dtype),
    )
    if rank == 0:
        with open(os.path.join(root, "report.json"), "w") as f:
            json.dump(report, f)


@pytest.mark.parametrize("offload", [False, True], ids=["gpu-resident", "cpu-offload"])
def test_bf16_engine_over_nccl(tmp_path, offload):
    world = min(2, torch.cuda.device_count())
    model_dir = build_tiny_causal_lm(str(tmp_path / "model"), seed=1)
    data = make_rl_batch([3, 20, 7, 1, 12, 5], [40, 9, 55, 3, 30, 18], vocab_size=128, seed=4)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        ref, _ = reference_log_probs(model, data)
    torch.save(data.to_dict(), tmp_path / "data.pt")
    torch.save(ref, tmp_path / "ref.pt")
    spawn_ranks(_gpu_worker, world, args=(str(tmp_path), model_dir, offload), timeout_s=300, backend="nccl")
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["log_prob_max_diff"] < 0.1, rep  # bf16 compute vs fp32 reference
    assert torch.isfinite(torch.tensor(rep["grad_norm"])) and rep["params_moved"] > 0
    assert rep["param_dtype"] == "torch.float32"  # fp32 master weights under bf16 compute
    assert rep["param_devices"] == (["cpu"] if offload else ["cuda"])
