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
