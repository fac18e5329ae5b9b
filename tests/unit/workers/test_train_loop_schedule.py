"""The update loop advances the learning-rate schedule once per update call, not per mini-batch.

Warmup and schedule length are counted in training steps (trainer steps), as in verl; stepping the
schedule per mini-batch made it run `mini-batches x epochs` times too fast. The engine here is a real
`TrainEngine` (its own optimizer_step / lr_scheduler_step) around a one-parameter model, with the
forward/backward replaced by a fixed gradient, so no process group is needed.
"""

from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from ballast.engine import EngineConfig, MicroBatchSpec
from ballast.engine import OptimConfig as EngineOptim
from ballast.engine.engine import TrainEngine
from ballast.engine.optim import build_optimizer, build_scheduler, lr_factor
from ballast.workers.spec import TrainLoopSpec
from ballast.workers.train_loop import run_train_loop

LR = 0.1


def _engine(optim: EngineOptim) -> TrainEngine:
    engine = object.__new__(TrainEngine)
    engine.cfg = EngineConfig(model_path="unused", optim=optim, grad_clip=1.0, device="cpu")
    engine.model = torch.nn.Linear(2, 1, bias=False)
    engine.optimizer = build_optimizer(engine.model.parameters(), optim)
    engine.scheduler = build_scheduler(engine.optimizer, optim)
    engine.global_step = engine.skipped_steps = 0
    engine.last_micro_batch_tokens = [[1]]
    engine.seen_lrs = []

    def forward_backward_batch(data, loss_fn, spec, **_):
        engine.seen_lrs.append(engine.optimizer.param_groups[0]["lr"])
        engine.model.weight.grad = torch.ones_like(engine.model.weight)
        return {"loss": 0.0, "num_sequences": float(data.batch_size[0])}

    engine.forward_backward_batch = forward_backward_batch
    return engine


def _spec(mini_batch: int, epochs: int) -> TrainLoopSpec:
    return TrainLoopSpec(mini_batch_samples_per_rank=mini_batch, ppo_epochs=epochs, shuffle=False, seed=0,
                         micro=MicroBatchSpec(micro_batch_size_per_gpu=1), loss_fn=lambda *a: None)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_schedule_steps_once_per_update_call(schedule):
    optim = EngineOptim(lr=LR, lr_schedule=schedule, warmup_steps=10, total_steps=100)
    engine = _engine(optim)
    data = TensorDict({"x": torch.zeros(8, 1)}, batch_size=[8])
    spec = _spec(mini_batch=2, epochs=2)  # 4 mini-batches x 2 epochs = 8 optimizer steps per update call
    for step in range(12):
        engine.seen_lrs.clear()
        metrics = run_train_loop(engine, data, spec, dp_rank=0, prefix="actor")
        expected = LR * lr_factor(step, optim)
        assert engine.seen_lrs == pytest.approx([expected] * 8), step
        assert metrics["actor/lr"] == pytest.approx(expected)
    assert engine.scheduler.last_epoch == 12 and engine.global_step == 12 * 8


def test_skipped_steps_total_is_the_running_count_not_a_mean():
    engine = _engine(EngineOptim(lr=LR))
    data = TensorDict({"x": torch.zeros(4, 1)}, batch_size=[4])
    calls = SimpleNamespace(n=0)
    real = engine.forward_backward_batch

    def nan_on_first(data, loss_fn, spec, **kw):
        out = real(data, loss_fn, spec, **kw)
        calls.n += 1
        if calls.n == 1:
            engine.model.weight.grad = torch.full_like(engine.model.weight, float("nan"))
        return out

    engine.forward_backward_batch = nan_on_first
    metrics = run_train_loop(engine, data, _spec(mini_batch=1, epochs=1), dp_rank=0, prefix="actor")
    assert metrics["actor/skipped_steps_total"] == 1.0
    assert metrics["actor/step_skipped"] == pytest.approx(0.25)
