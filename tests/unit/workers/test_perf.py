"""MFU metrics: FLOPs from the model's FLOPs model over seconds x peak, and the peak lookup."""

from types import SimpleNamespace

import pytest
import torch

from ballast.balance import FlopsModel
from ballast.workers import perf

MODEL = FlopsModel(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_size=100)


def _engine(workload=MODEL, dp=1, sp=1):
    parallel = SimpleNamespace(dp_size=dp, sp_size=sp, world_size=dp * sp, device=torch.device("cpu"), dp_group=None)
    return SimpleNamespace(workload=workload, parallel=parallel)


def test_mfu_is_model_flops_over_seconds_times_peak():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    flops = 3 * float(MODEL([3, 4]).sum())
    out = perf.mfu_metrics("actor", _engine(), {"attention_mask": mask}, seconds=2.0, peak=1e6, passes=3)
    assert out == {"perf/mfu/actor": pytest.approx(flops / 2e6)}
    # every rank of the mesh counts in the denominator (dp=1 here, sp=2: two ranks, the same rows)
    out = perf.mfu_metrics("actor", _engine(sp=2), {"attention_mask": mask}, seconds=2.0, peak=1e6, passes=3)
    assert out["perf/mfu/actor"] == pytest.approx(flops / 4e6)
    # no FLOPs model or no peak: nothing reported rather than a made-up number
    assert perf.mfu_metrics("actor", _engine("tokens"), {"attention_mask": mask}, 2.0, 1e6, 3) == {}
    assert perf.mfu_metrics("actor", _engine(), {"attention_mask": mask}, 2.0, None, 3) == {}


def test_peak_is_measured_on_cpu_and_looked_up_on_gpu(monkeypatch):
    assert perf.cpu_matmul_peak_flops(size=64, seconds=0.05) > 1e6
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert perf.peak_flops("cuda") == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some Future GPU")
    assert perf.peak_flops("cuda") is None


def test_the_old_log_prob_pass_reports_verls_actor_infer_mfu():
    """The old-log-prob pass's MFU carries verl's name, `perf/mfu/actor_infer`."""
    from ballast.protocol import Batch
    from ballast.workers.actor_rollout_ref import TrainerWorker

    worker = TrainerWorker(SimpleNamespace(actor_infer=None, temperature=1.0))
    worker.actor = _engine()
    worker.actor.infer_batch = lambda data, spec, **kw: {"log_probs": torch.zeros(2, 2), "entropy": torch.ones(2, 2)}
    worker._peak_flops = 1e6
    mask = torch.ones(2, 4, dtype=torch.long)
    batch = Batch({"input_ids": mask, "attention_mask": mask, "position_ids": mask.cumsum(-1)})
    out = worker.compute_log_prob(batch, SimpleNamespace(mini_batches=[SimpleNamespace(shared_prompts=False)]))
    assert set(out.metrics) == {"perf/mfu/actor_infer"}
    assert out.metrics["perf/mfu/actor_infer"][0] > 0


def test_a_shared_prompt_counts_once_per_group():
    """Shared FLOPs = each group's prompt once + every response attending to it and to itself, derived
    here from the shared pack's structure; fewer than the rows' own."""
    from ballast.engine.padding import response_slots
    from ballast.engine.shared_prefix import pack_shared
    from testkit.engine import make_rl_batch

    data = make_rl_batch([5, 5, 3, 5, 3], [4, 0, 6, 2, 7], vocab_size=50, seed=1)
    width = data["input_ids"].shape[1] - data["responses"].shape[1]
    for row, first in ((1, 0), (3, 0), (4, 2)):
        data["input_ids"][row, :width] = data["input_ids"][first, :width]
    pack = pack_shared(data["input_ids"], data["attention_mask"], data["position_ids"],
                       response_slots(data["attention_mask"], data["responses"].shape[1]))
    lin, att = MODEL.linear_flops_per_token, MODEL.attention_flops_per_pair
    expected = sum(p * lin + att * p * (p + 1) / 2 + sum(r * lin + att * r * (p + (r + 1) / 2) for r in rs)
                   for p, rs in ((g.prompt_len, g.response_lens) for g in pack.groups))
    assert perf.pass_flops(_engine(), data, 1, shared_prompts=True) == pytest.approx(expected)
    assert perf.pass_flops(_engine(), data, 1) > expected * 1.3
