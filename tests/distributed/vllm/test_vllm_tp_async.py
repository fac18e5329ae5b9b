"""Async rollout under a real TP=2 vLLM engine on CPU: the leader runs every conversation of the group,
the follower replays its engine steps; single-turn equals batched TP generation token for token, multi-
turn log-probs line up with the final sequences, and a leader-side failure raises on both ranks."""

import os

import pytest
import torch

from ballast.workers.rollout.vllm_shm import clean_stale_vllm_shm
from test_vllm_tp import _run_two_ranks

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp2_async_worker.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from ballast.models import build_tiny_model

    return str(build_tiny_model(str(tmp_path_factory.mktemp("tp_async_tiny")), preset="tiny", seed=0))


def test_tp2_async_rollout(model_dir, tmp_path, tp_host_lock):
    clean_stale_vllm_shm()
    results = _run_two_ranks(model_dir, str(tmp_path), worker=WORKER)
    for rank, res in enumerate(results):
        for key, value in res["batched"].items():  # single-turn async == batched TP, token for token
            assert torch.equal(res["async"][key], value), (rank, key)
        multi = res["multi"]
        assert res["multi_turns"] == [5] * len(res["input"]["input_ids"])
        for row, teacher in enumerate(res["teacher"]):
            n = int(multi["attention_mask"][row, -32:].sum())
            mask = multi["response_mask"][row, :n].bool()
            assert torch.allclose(multi["rollout_log_probs"][row, :n][mask], teacher[-n:][mask], atol=1e-4)
        assert res["error"] is not None and res["alive"]
    assert "no_such_loop" in results[0]["error"]
    assert "TP leader (rank 0) failed" in results[1]["error"]
