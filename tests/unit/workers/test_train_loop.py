"""The update loop's pure parts: mini-batch indices per epoch and adaptive gradient clipping."""

import numpy as np
import pytest

from ballast.workers.train_loop import adaptive_grad_clip, mini_batch_indices


def test_every_row_once_per_epoch_and_shuffle_depends_on_the_seed():
    batches = list(mini_batch_indices(12, 4, epochs=2, shuffle=True, seed=5))
    assert len(batches) == 6 and all(len(b) == 4 for b in batches)
    for epoch in (batches[:3], batches[3:]):
        assert sorted(np.concatenate(epoch).tolist()) == list(range(12))
    assert not np.array_equal(np.concatenate(batches[:3]), np.concatenate(batches[3:]))
    other_rank = list(mini_batch_indices(12, 4, epochs=2, shuffle=True, seed=6))  # seed + dp_rank
    assert not np.array_equal(np.concatenate(batches), np.concatenate(other_rank))
    assert [b.tolist() for b in mini_batch_indices(4, 2, 1, False, 0)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="holds 10 samples, not a multiple of mini_batch_samples_per_rank=4"):
        list(mini_batch_indices(10, 4, 1, False, 0))


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

    def __init__(self):
        self.calls = []
        self.last_micro_batch_tokens = [[1]]

    def zero_grad(self):
        pass

    def forward_backward_batch(self, data, loss_fn, spec, temperature, calculate_entropy, plan):
        self.calls.append((data["x"].tolist(), plan))
        return {"loss": 1.0, "num_sequences": float(len(data["x"]))}

    def optimizer_step(self, grad_clip=None):
        return {"grad_norm": 1.0, "lr": 0.1, "step_skipped": 0.0, "skipped_steps": 0.0}


def test_a_central_plan_fixes_the_mini_batches_and_reaches_the_engine():
    import torch
    from tensordict import TensorDict

    from ballast.engine import MicroBatchSpec
    from ballast.workers.spec import TrainLoopSpec
    from ballast.workers.train_loop import run_train_loop

    spec = TrainLoopSpec(mini_batch_samples_per_rank=2, ppo_epochs=5, shuffle=True, seed=0,
                         micro=MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=8), loss_fn=None)
    data = TensorDict({"x": torch.arange(6)}, batch_size=[6])
    plans = [[[[1], [0]]], [[[0, 1]]], [[[0], [1]]]]
    engine = _RecordingEngine()
    run_train_loop(engine, data, spec, dp_rank=0, prefix="actor", plans=plans)
    # the driver already shuffled and repeated epochs: consecutive slices, one per plan, in order
    assert engine.calls == [([0, 1], plans[0]), ([2, 3], plans[1]), ([4, 5], plans[2])]
    with pytest.raises(ValueError, match="holds 6 samples but the central plan has 2 mini-batches"):
        run_train_loop(_RecordingEngine(), data, spec, dp_rank=0, prefix="actor", plans=plans[:2])
