"""A real TP=2 vLLM rollout on CPU: two processes (gloo world, external_launcher engine), each with
its own prompts; the leader runs every conversation of the group, the follower replays its engine
steps, and each rank gets back exactly its own rows, as generating them alone gives; weight sync from
FSDP2 under TP; multi-turn log-probs line up with the final sequences, and a leader-side failure raises
on both ranks. The rollout samples what the batched TP=2 rollout recorded (tests/fixtures/same_tokens.json).

The tests assert on one launch of tp2_rollout_worker.py (module fixture `tp2_results`): a TP=2 vLLM
start-up is ~25 s on 2 cores, and what each test checks is a separate step of that one run.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest
import torch

from ballast.workers.rollout.vllm_shm import clean_stale_vllm_shm, vllm_shm_files
from testkit import same_tokens

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # ~25 s on 2 cores: one launch, two ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp2_rollout_worker.py")
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(model_dir, out_dir, worker=WORKER):
    """Start both ranks of `worker`; a hang or a crash fails the test with both ranks' logs."""
    port = _free_port()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    procs, logs = [], []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
        log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, worker, model_dir, out_dir], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one rank died: its peer would wait in a collective forever
            time.sleep(0.5)
    finally:
        hung = [p for p in procs if p.poll() is None]
        for p in hung:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for log in logs:
            log.close()
    if hung or any(p.returncode != 0 for p in procs):
        tails = []
        for rank in range(2):
            with open(os.path.join(out_dir, f"rank{rank}.log")) as f:
                tails.append(f"--- rank {rank} (rc={procs[rank].returncode}) ---\n" + f.read()[-4000:])
        reason = f"timed out after {TIMEOUT_S} s" if hung else "a rank failed"
        pytest.fail(f"TP=2 rollout {reason}\n" + "\n".join(tails))
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def tp2_model_dir(tmp_path_factory):
    """The tiny preset with its tokenizer (the agent loops need one), but a separate lm_head (like the
    larger Qwen2 models; the tied layout's weight sync is checked in test_vllm_backend.py) and the
    init std of testkit.models (0.2): peaked next-token distributions give greedy decoding clear winners."""
    from ballast.models import build_tiny_model

    return str(build_tiny_model(str(tmp_path_factory.mktemp("tp2_untied")), preset="tiny", seed=0,
                                tie_word_embeddings=False, initializer_range=0.2))


@pytest.fixture(scope="module")
def tp2_results(tp2_model_dir, tmp_path_factory, tp_host_lock):
    clean_stale_vllm_shm()
    results = _run_two_ranks(tp2_model_dir, str(tmp_path_factory.mktemp("tp2_run")))
    # Clean exits unlink the all-reduce shared memory; nothing is left for the next engine to trip on.
    return results, (clean_stale_vllm_shm(), vllm_shm_files())


def test_tp2_rollout_each_rank_gets_its_own_slice(tp2_results):
    results, leftovers = tp2_results
    assert leftovers == ([], [])

    for rank, res in enumerate(results):
        assert res["engine_tp_ranks"] == res["group_ranks"] == [0, 1]
        assert res["default_group_alive_after_generate"]

    for rank, res in enumerate(results):
        out, mine, alone = res["output"], res["input"], res["alone"][rank]
        # Exactly this rank's rows, in order, with its own prompt width.
        assert torch.equal(out["prompts"], mine["input_ids"])
        assert out["responses"].shape == (len(mine["input_ids"]), 10)
        p = mine["input_ids"].shape[1]
        assert torch.equal(out["attention_mask"][:, :p], mine["attention_mask"])
        # The same responses as generating this rank's prompts alone (left padding differs).
        assert torch.equal(out["responses"], alone["responses"])
        assert torch.equal(out["response_mask"], alone["response_mask"])
        assert torch.allclose(out["rollout_log_probs"], alone["rollout_log_probs"], atol=1e-4)
        real = out["attention_mask"].bool()
        for i in range(len(real)):
            assert out["position_ids"][i][real[i]].tolist() == list(range(int(real[i].sum())))
    # The shared prompt [9] gets the same greedy answer on both ranks.
    assert torch.equal(results[0]["output"]["responses"][1], results[1]["output"]["responses"][1])
    # Sampling under TP: both ranks drew identical tokens and log-probs (per-row seeds).
    s0, s1 = results[0]["sampled"], results[1]["sampled"]
    assert torch.equal(s0["responses"], s1["responses"])
    assert torch.equal(s0["rollout_log_probs"], s1["rollout_log_probs"])

    for res in results:
        ws = res["weight_sync"]
        assert ws["count"] == ws["num_state"]
        assert (ws["before"] - ws["target"]).abs().max() > 1e-2  # the AdamW step moved the model
        assert (ws["after"] - ws["target"]).abs().max() <= 1e-4  # vLLM (TP=2) now matches FSDP2


def test_tp2_samples_the_tokens_the_batched_rollout_recorded(tp2_results, tp2_model_dir):
    """tests/fixtures/same_tokens.json: what the batched TP=2 rollout recorded on each rank
    (sampled, filtered, greedy), through the group's rollout."""
    fixture = same_tokens.load()
    same_tokens.check_model(fixture, "tp2", tp2_model_dir)
    for rank, res in enumerate(tp2_results[0]):
        same_tokens.check_engine(fixture, "vllm_tp2", types.SimpleNamespace(**res["engine"]))
        assert sorted(res["same_tokens"]) == sorted(fixture["calls"])
        for name, out in res["same_tokens"].items():
            same_tokens.assert_same_tokens(fixture["results"]["vllm_tp2"][str(rank)][name], out,
                                           f"vllm_tp2/rank{rank}/{name}")


def test_tp2_async_rollout(tp2_results):
    results = [res["async"] for res in tp2_results[0]]
    for rank, res in enumerate(results):
        multi = res["multi"]
        assert res["multi_turns"] == [5] * len(res["input"]["input_ids"])
        for row, teacher in enumerate(res["teacher"]):
            n = int(multi["attention_mask"][row, -32:].sum())
            mask = multi["response_mask"][row, :n].bool()
            assert torch.allclose(multi["rollout_log_probs"][row, :n][mask], teacher[-n:][mask], atol=1e-4)
        assert res["error"] is not None and res["alive"]
    assert "no_such_loop" in results[0]["error"]
    assert "TP leader (rank 0) failed" in results[1]["error"]
