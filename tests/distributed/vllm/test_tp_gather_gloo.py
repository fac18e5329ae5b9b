"""TP gather/split over a real gloo group (3 processes, no vLLM): uneven rows and widths, an empty
rank, the lockstep check, invalid prompts on one rank failing on all, and every rank getting
exactly its own rows back."""

import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ballast.workers.rollout.base import RolloutConfig, SamplingConfig
from ballast.workers.rollout.postprocess import build_rollout_output, read_prompts
from testkit.prompts import left_padded_prompts

WORLD = 3
PROMPTS = {0: [[5, 6, 7], [9]], 1: [], 2: [[20, 21, 22, 23, 24], [9], [30, 31]]}
WIDTH = {0: 4, 1: 2, 2: 6}


def make_prompts(lists, width):
    return left_padded_prompts(lists, width, position_ids=True)


class RowWiseBackend:
    """A deterministic stand-in engine: each response depends only on its own prompt row."""

    def __init__(self):
        self.config = RolloutConfig(model_path="/unused", backend="hf", sampling=SamplingConfig(seed=1))
        self.pad_token_id = 0
        self.calls = []

    def generate(self, prompts, sampling=None, call_index=None):
        ids, mask, pos, lists = read_prompts(prompts)
        self.calls.append(lists)
        responses = [[sum(t) % 50 + 2, len(t) + 2] for t in lists]
        return build_rollout_output(ids, mask, pos, responses, [[-1.0, -2.0]] * len(lists), pad_token_id=0)


def _rank_main(rank, port, out_dir):
    from ballast.workers.rollout.tp import new_tp_group, tp_generate

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    group = new_tp_group(WORLD)
    backend = RowWiseBackend()
    mine = make_prompts(PROMPTS[rank], WIDTH[rank])
    out = tp_generate(backend, mine, group)
    alone = backend.generate(mine) if len(mine) else None
    # A rank passing a different sampling config must fail on every rank, not hang.
    try:
        tp_generate(backend, mine, group, SamplingConfig(seed=rank))
        mismatch = None
    except RuntimeError as e:
        mismatch = str(e)
    # Invalid prompts on one rank (right-padded on rank 2) raise on every rank, before any hang.
    bad = make_prompts(PROMPTS[rank], WIDTH[rank])
    if rank == 2:
        bad["attention_mask"][0] = torch.tensor([1, 1, 1, 1, 1, 0])
    try:
        tp_generate(backend, bad, group)
        invalid = None
    except ValueError as e:
        invalid = str(e)
    torch.save({"out": out.to_dict(), "mine": mine.to_dict(), "alone": None if alone is None else alone.to_dict(),
                "engine_calls": backend.calls[:1], "num_engine_calls": len(backend.calls), "mismatch": mismatch,
                "invalid": invalid}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp_generate_over_gloo(tmp_path):
    # fork when it is safe: no other Python threads except tqdm's monitor (a daemon that only
    # sleeps on an Event; transformers' loading bars start it). With Ray's or vLLM's threads around,
    # spawn. Three fresh interpreters importing torch took 20-40 s on 2 busy cores; forks start at once.
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    start_method = "fork" if all(t.daemon and t.name == "tqdm_monitor" for t in others) else "spawn"
    ctx = mp.start_processes(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False,
                             start_method=start_method)
    try:
        for _ in range(120):
            if ctx.join(timeout=1):
                break
        else:
            pytest.fail("gloo TP gather test hung for 120 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    res = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(WORLD)]
    gathered = [t for r in range(WORLD) for t in PROMPTS[r]]
    for r in range(WORLD):
        # Every rank ran the engine on the same gathered batch, in rank order.
        assert res[r]["engine_calls"][0] == gathered
        out, mine = res[r]["out"], res[r]["mine"]
        assert torch.equal(out["prompts"], mine["input_ids"])
        assert out["input_ids"].shape == (len(PROMPTS[r]), WIDTH[r] + 2)
        if res[r]["alone"] is not None:
            for key, value in res[r]["alone"].items():
                assert torch.equal(out[key], value), (r, key)
        assert "differ" in res[r]["mismatch"]
        assert "not left-padded" in res[r]["invalid"] if r == 2 else "ranks [2]" in res[r]["invalid"]
        # The engine ran once per rank for the good call (+1 for the 'alone' reference), never for the bad ones.
        assert res[r]["num_engine_calls"] == 1 + (res[r]["alone"] is not None)
