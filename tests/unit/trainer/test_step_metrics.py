"""Per-phase step metrics: worker-reported phase times and milliseconds per token."""

import pytest
import torch

from ballast.protocol import Batch
from ballast.trainer.metrics import pop_worker_timing, timing_per_token_metrics


def _batch():
    attention = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])  # 4 + 6 = 10 tokens
    response = torch.tensor([[1, 1, 0], [1, 1, 1]])  # 5 response tokens
    return Batch({"attention_mask": attention, "response_mask": response},
                 meta={"metrics": {"timing_s/weight_sync": [0.2, 0.5], "perf/other": [1.0]}, "keep": 1})


def test_worker_timing_takes_the_slowest_rank_and_leaves_the_batch_clean():
    batch = _batch()
    assert pop_worker_timing(batch) == {"weight_sync": 0.5}
    assert "metrics" not in batch.meta and batch.meta["keep"] == 1
    assert pop_worker_timing(batch) == {}


def test_generation_is_per_response_token_and_the_rest_per_token():
    out = timing_per_token_metrics(_batch(), {"step": 9.0, "gen": 1.0, "weight_sync": 0.5, "update_actor": 2.0})
    assert out == pytest.approx({"timing_per_token_ms/gen": 200.0, "timing_per_token_ms/weight_sync": 100.0,
                                 "timing_per_token_ms/update_actor": 200.0})
