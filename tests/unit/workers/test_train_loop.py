"""The update loop executes the driver's plan: consecutive slices per mini-batch, the plan's
micro-batches reach the engine, the first mini-batch's own loss, and adaptive gradient clipping."""

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from ballast.balance import MicroBatchMode, MicroBatchPolicy, plan_phase
from ballast.workers.spec import TrainLoopSpec
from ballast.workers.train_loop import adaptive_grad_clip, rank_mini_batches, run_train_loop


def test_adaptive_clip_scales_linearly_below_the_minimum():
    assert adaptive_grad_clip(1.0, num_samples=4, min_batch_size=8) == pytest.approx(0.5)
    assert adaptive_grad_clip(1.0, num_samples=1, min_batch_size=8) == pytest.approx(0.125)
    assert adaptive_grad_clip(1.0, num_samples=8, min_batch_size=8) == 1.0
    assert adaptive_grad_clip(2.0, num_samples=64, min_batch_size=8) == 2.0
    assert adaptive_grad_clip(1.0, num_samples=4, min_batch_size=None) == 1.0


class _RecordingEngine:
    """Stands in for TrainEngine: records what each forward_backward_batch call received."""

    class cfg:  # noqa: N801 - mimics the engine's attribute
        grad_clip = None

    def __init__(self, dp_rank=0):
        self.calls = []
        self.last_micro_batch_tokens = [[1]]
        self.parallel = type("P", (), {"dp_rank": dp_rank})()

    def zero_grad(self):
        pass

    def forward_backward_batch(self, data, loss_fn, plan, temperature, calculate_entropy):
        old = data["old_log_probs"][:, 0].tolist() if "old_log_probs" in data.keys() else None
        self.calls.append((data["x"].tolist(), plan, loss_fn, calculate_entropy, old))
        return {"loss": 1.0, "num_sequences": float(len(data["x"]))}

    def optimizer_step(self, grad_clip=None, step_scheduler=True):
        return {"grad_norm": 1.0, "lr": 0.1, "step_skipped": 0.0, "skipped_steps": 0.0}

    def lr_scheduler_step(self):
        pass


PLAN = plan_phase(np.arange(1, 13), 2, MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=20),
                  mini_batch_samples=4, epochs=2, shuffle=True, seed=3)


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_the_plan_fixes_the_mini_batches_and_reaches_the_engine(dp_rank):
    data = TensorDict({"x": torch.arange(12)}, batch_size=[12])  # this rank's chunk: 3 x 2 epochs x 2 rows
    engine = _RecordingEngine(dp_rank)
    run_train_loop(engine, data, PLAN, TrainLoopSpec(loss_fn="loss"), prefix="actor")
    assert [c[0] for c in engine.calls] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert [c[1] for c in engine.calls] == list(PLAN.mini_batches)
    with pytest.raises(ValueError, match="holds 10 rows but its plan covers 12"):
        list(rank_mini_batches(PLAN, dp_rank, 10))


def test_the_first_mini_batch_can_make_its_own_old_log_probs():
    plan = plan_phase([5] * 8, 1, MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=2), mini_batch_samples=4)
    data = TensorDict({"x": torch.arange(8)}, batch_size=[8])
    later = torch.arange(4, 8, dtype=torch.float32)[:, None].repeat(1, 3)
    engine = _RecordingEngine()
    run_train_loop(engine, data, plan, TrainLoopSpec(loss_fn="loss"), prefix="actor", first_loss_fn="first",
                   later_old_log_probs=later)
    (_, _, loss0, entropy0, old0), (_, _, loss1, entropy1, old1) = engine.calls
    assert (loss0, entropy0, old0) == ("first", True, None)  # its own, with entropies to return
    assert (loss1, entropy1, old1) == ("loss", False, [4.0, 5.0, 6.0, 7.0])
