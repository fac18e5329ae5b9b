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

from ballast.balance import MicroBatchMode, MicroBatchPolicy, plan_phase
from ballast.engine import OptimConfig as EngineOptim
from ballast.engine.optim import lr_factor
from testkit.engine import schedule_probe_engine
from ballast.workers.spec import TrainLoopSpec
from ballast.workers.train_loop import run_train_loop

LR = 0.1


def _engine(optim: EngineOptim):
    return schedule_probe_engine(optim)


SPEC = TrainLoopSpec(loss_fn=lambda *a: None)


def _plan(rows: int, mini_batch: int, epochs: int):
    """The driver's plan of one rank's update: `epochs` passes over `rows` rows in mini-batches."""
    return plan_phase([3] * rows, 1, MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=1),
                      mini_batch_samples=mini_batch, epochs=epochs)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_schedule_steps_once_per_update_call(schedule):
    optim = EngineOptim(lr=LR, lr_schedule=schedule, warmup_steps=10, total_steps=100)
    engine = _engine(optim)
    plan = _plan(8, mini_batch=2, epochs=2)  # 4 mini-batches x 2 epochs = 8 optimizer steps per update call
    data = TensorDict({"x": torch.zeros(16, 1)}, batch_size=[16])  # every row once per epoch
    for step in range(12):
        engine.seen_lrs.clear()
        metrics = run_train_loop(engine, data, plan, SPEC, prefix="actor").metrics
        expected = LR * lr_factor(step, optim)
        assert engine.seen_lrs == pytest.approx([expected] * 8), step
        assert metrics["actor/lr"] == pytest.approx(expected)
    assert engine.scheduler.last_epoch == 12 and engine.global_step == 12 * 8


def test_skipped_steps_total_is_the_running_count_not_a_mean():
    engine = _engine(EngineOptim(lr=LR))
    data = TensorDict({"x": torch.zeros(4, 1)}, batch_size=[4])
    calls = SimpleNamespace(n=0)
    real = engine.forward_backward_batch

    def nan_on_first(data, loss_fn, plan, **kw):
        out = real(data, loss_fn, plan, **kw)
        calls.n += 1
        if calls.n == 1:
            engine.model.weight.grad = torch.full_like(engine.model.weight, float("nan"))
        return out

    engine.forward_backward_batch = nan_on_first
    metrics = run_train_loop(engine, data, _plan(4, mini_batch=1, epochs=1), SPEC, prefix="actor").metrics
    assert metrics["actor/skipped_steps_total"] == 1.0
    assert metrics["actor/step_skipped"] == pytest.approx(0.25)
