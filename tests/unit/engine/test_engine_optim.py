"""Learning-rate schedule values, config validation, and skipping non-finite steps."""

import math

import pytest
import torch

from ballast.engine.config import EngineConfig, MicroBatchSpec, OptimConfig
from ballast.engine.optim import build_optimizer, build_scheduler, clip_and_step, lr_factor


def test_constant_with_warmup():
    cfg = OptimConfig(lr=1.0, warmup_steps=4)
    assert [lr_factor(s, cfg) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, OptimConfig()) == 1.0


def test_cosine_with_warmup_hits_its_end_points():
    cfg = OptimConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    values = [lr_factor(s, cfg) for s in range(15)]
    assert values[:2] == [0.5, 1.0]
    assert values[2] == pytest.approx(1.0)
    assert values[7] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert values[12] == pytest.approx(0.1) and values[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[2:], values[3:]))


def test_scheduler_drives_the_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(3))
    cfg = OptimConfig(lr=0.2, lr_schedule="cosine", warmup_steps=1, total_steps=3)
    opt = build_optimizer([p], cfg)
    sched = build_scheduler(opt, cfg)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(3)
        clip_and_step([p], opt, sched, max_norm=1.0)
    assert seen == pytest.approx([0.2 * lr_factor(s, cfg) for s in range(4)])


def test_non_finite_gradient_step_is_skipped_and_leaves_state_alone():
    p = torch.nn.Parameter(torch.ones(4))
    cfg = OptimConfig(lr=0.1, warmup_steps=3)
    opt = build_optimizer([p], cfg)
    sched = build_scheduler(opt, cfg)
    p.grad = torch.tensor([1.0, float("nan"), 0.0, 0.0])
    norm, stepped = clip_and_step([p], opt, sched, max_norm=1.0)
    assert not stepped and math.isnan(norm)
    assert torch.equal(p.detach(), torch.ones(4)) and p.grad is None
    assert opt.state[p] == {} and sched.last_epoch == 0
    p.grad = torch.full((4,), float("inf"))
    assert clip_and_step([p], opt, sched, max_norm=None)[1] is False
    p.grad = torch.ones(4)
    norm, stepped = clip_and_step([p], opt, sched, max_norm=1.0)
    assert stepped and norm == pytest.approx(2.0)
    assert not torch.equal(p.detach(), torch.ones(4)) and sched.last_epoch == 1


def test_cpu_optimizer_is_the_fused_kernel_and_matches_the_reference_adamw():
    torch.manual_seed(0)
    init = [torch.randn(33, 7), torch.randn(7)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(5)]
    cfg = OptimConfig(lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6)

    def run(make):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = make(params)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        return opt, [p.detach() for p in params]

    ours, got = run(lambda ps: build_optimizer(ps, cfg))
    assert ours.defaults["fused"] is True
    _, want = run(lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6,
                                               foreach=False))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr_schedule="linear"), "lr_schedule must be one of"),
        (dict(lr_schedule="cosine", warmup_steps=5, total_steps=5), "total_steps > optim.warmup_steps"),
        (dict(min_lr_ratio=2.0), "min_lr_ratio must be in"),
    ],
)
def test_optim_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(**kwargs)


def test_engine_config_and_spec_validation():
    with pytest.raises(ValueError, match="needs use_remove_padding=True"):
        EngineConfig(model_path="x", ulysses_sequence_parallel_size=2, use_remove_padding=False)
    with pytest.raises(ValueError, match="role must be one of"):
        EngineConfig(model_path="x", role="policy")
    with pytest.raises(ValueError, match="needs max_token_len_per_gpu >= 1, got None"):
        MicroBatchSpec(use_dynamic_bsz=True)
    with pytest.raises(ValueError, match="needs micro_batch_size_per_gpu >= 1, got 0"):
        MicroBatchSpec(micro_batch_size_per_gpu=0)
    assert MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=100).token_budget(sp_size=4) == 400
