"""The TP rollout mechanism (leader runs the conversations, followers replay its engine steps) over a
real gloo group of 3 processes, no vLLM: uneven rows and widths and an empty rank, every rank's engine
fed the same requests in the same order, every rank getting back what generating its own prompts alone
gives, arguments that differ between ranks and invalid prompts on one rank failing on every rank; and
partial rollouts, where the leader switches weights mid-call and every rank must switch between the
same two engine steps, so that each token's recorded version is the one that sampled it on every rank,
each follower taking the weights from its own source (they cannot be pickled over the group)."""

import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ballast.protocol import Batch
from ballast.workers.rollout.async_engine import finish
from ballast.workers.rollout.base import RolloutConfig, SamplingConfig
from testkit.prompts import left_padded_prompts

WORLD = 3
PROMPTS = {0: [[5, 6, 7], [9]], 1: [], 2: [[20, 21, 22, 23, 24], [9], [30, 31]]}
WIDTH = {0: 4, 1: 2, 2: 6}
SAMPLING = SamplingConfig(max_response_length=4, seed=1, calculate_log_probs=True)


class RowWiseCore:
    """A deterministic stand-in engine core: each request finishes in its first step, its response
    depending only on its own prompt; every add is recorded."""

    def __init__(self, log):
        self.live, self.log = [], log

    def add(self, request_id, request):
        self.live.append((request_id, request))
        self.log.append(list(request.prompt_ids))

    def step(self):
        done = [(rid, finish([sum(r.prompt_ids) % 50 + 2, len(r.prompt_ids) + 2], [-1.0, -2.0], (), r.max_tokens))
                for rid, r in self.live]
        self.live = []
        return done

    def has_unfinished(self):
        return bool(self.live)

    def abort_all(self):
        self.live = []


class StepwiseCore:
    """A resumable stand-in core: one token per live request per step, whose value is the served weight
    version; every step and every weight load is logged, with the versions in play."""

    def __init__(self, backend):
        self.backend, self.live = backend, {}

    def add(self, request_id, request):
        self.live[request_id] = (request, [])

    def step(self):
        version = self.backend.version
        self.backend.log.append(("step", version, sorted(self.live)))
        done = []
        for rid, (request, sofar) in list(self.live.items()):
            sofar.append(VERSION_TOKEN + version)
            if len(sofar) == request.max_tokens:
                done.append((rid, finish(sofar, [-0.5] * len(sofar), (), request.max_tokens)))
                del self.live[rid]
        return done

    def has_unfinished(self):
        return bool(self.live)

    def abort_all(self):
        self.live = {}

    def interrupt(self):
        partial = [(rid, sofar, [-0.5] * len(sofar)) for rid, (_, sofar) in self.live.items()]
        self.live = {}
        return partial


VERSION_TOKEN = 40  # a token sampled under weight version v is VERSION_TOKEN + v


class Weights:
    """A weight version that, like an export's Ray object references, is only good in the process whose
    source handed it out: it refuses to be pickled, so it cannot travel over the TP group."""

    def __init__(self, version):
        self.version = version

    def __reduce__(self):
        raise TypeError("weights must reach a TP follower through its own source, not over the TP group")


class Updates:
    """Weights that become newer after the leader's second engine step; only the leader is asked for
    them, it shares them with its followers, every rank loads them (the followers take them by key)."""

    def __init__(self, backend):
        self.backend, self.version, self.shared = backend, 0, []

    def newer(self):
        steps = sum(1 for entry in self.backend.log if entry[0] == "step")
        return Weights(self.version + 1) if steps in (2, 3) and self.version < steps - 1 else None

    def share(self, weights, takers):
        self.shared.append((weights.version, takers))
        return weights.version

    def take(self, key):
        return Weights(key)

    def load(self, weights):
        self.backend.log.append(("load", weights.version))
        self.backend.version = self.version = weights.version
        return weights.version


class RowWiseBackend:
    def __init__(self):
        self.config = RolloutConfig(model_path="/unused", backend="hf", sampling=SAMPLING)
        self.pad_token_id, self.eos_token_ids, self.vocab_size, self.max_model_len = 0, (), 100, None
        self.num_calls, self.requests = 0, []
        self.version, self.log = 0, []

    def core(self, sampling, resumable=False):
        return StepwiseCore(self) if resumable else RowWiseCore(self.requests)


def _rank_main(rank, port, out_dir):
    from ballast.workers.agent_loop import AgentLoopRunner
    from ballast.workers.agent_loop.tp import new_tp_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    backend = RowWiseBackend()
    runner = AgentLoopRunner(backend, group=new_tp_group(WORLD))
    mine = left_padded_prompts(PROMPTS[rank], WIDTH[rank], position_ids=True)
    out = runner.generate(Batch(mine), call_index=3)
    requests = list(backend.requests)
    alone = AgentLoopRunner(RowWiseBackend()).generate(Batch(mine), call_index=3) if len(mine) else None
    errors = {}
    bad = left_padded_prompts(PROMPTS[rank], WIDTH[rank], position_ids=True)
    if rank == 2:  # right-padded on rank 2 only
        bad["attention_mask"][0] = torch.tensor([1, 1, 1, 1, 1, 0])
    for name, call in (("mismatch", lambda: runner.generate(Batch(mine), SamplingConfig(seed=rank))),
                       ("invalid", lambda: runner.generate(Batch(bad)))):
        try:
            call()
            errors[name] = None
        except (ValueError, RuntimeError) as err:
            errors[name] = str(err)
    updates = Updates(backend)
    partial = runner.generate(Batch(mine), call_index=4, updates=updates)
    torch.save({"partial": partial.tensors.to_dict(), "log": backend.log, "version": backend.version,
                "shared": updates.shared,
                "out": out.tensors.to_dict(), "turns": out.columns["agent_num_turns"].tolist(),
                "mine": mine.to_dict(), "alone": None if alone is None else alone.tensors.to_dict(),
                "requests": requests, "calls": backend.num_calls, **errors}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp_rollout_over_gloo(tmp_path):
    # fork when it is safe: no other Python threads except tqdm's monitor (a daemon that only sleeps on
    # an Event). With Ray's or vLLM's threads around, spawn. Fresh interpreters importing torch took
    # 20-40 s on 2 busy cores; forks start at once.
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    start_method = "fork" if all(t.daemon and t.name == "tqdm_monitor" for t in others) else "spawn"
    ctx = mp.start_processes(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False,
                             start_method=start_method)
    try:
        for _ in range(120):
            if ctx.join(timeout=1):
                break
        else:
            pytest.fail("gloo TP rollout test hung for 120 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    res = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(WORLD)]
    gathered = [t for r in range(WORLD) for t in PROMPTS[r]]
    for r in range(WORLD):
        # Every rank's engine got the gathered requests, in rank order (the followers by replay).
        assert res[r]["requests"] == gathered
        out, mine = res[r]["out"], res[r]["mine"]
        assert torch.equal(out["prompts"], mine["input_ids"])  # its own rows at its own width
        assert out["input_ids"].shape == (len(PROMPTS[r]), WIDTH[r] + 4)
        assert res[r]["turns"] == [2] * len(PROMPTS[r])
        if res[r]["alone"] is not None:
            for key, value in res[r]["alone"].items():
                assert torch.equal(out[key], value), (r, key)
        assert "the TP ranks' generate calls differ" in res[r]["mismatch"]
        assert "row 2 is not left-padded" in res[r]["invalid"]
        # Every call was numbered alike on every rank (the failed ones included).
        assert res[r]["calls"] == res[0]["calls"]
    # Partial rollouts: the leader switched weights twice (before its 3rd and 4th engine steps); every rank
    # logged the same steps with the same requests and versions and loaded each version at the same point.
    assert [e[0] for e in res[0]["log"]] == ["step", "step", "load", "step", "load", "step"]
    for r in range(WORLD):
        assert res[r]["log"] == res[0]["log"] and res[r]["version"] == 2
        # only the leader shared them, once per switch, for its 2 followers
        assert res[r]["shared"] == ([(1, WORLD - 1), (2, WORLD - 1)] if r == 0 else [])
        part = res[r]["partial"]
        real = part["response_mask"].bool()
        assert real.sum() == 4 * len(PROMPTS[r])
        # every sampled token's recorded version is the version that sampled it (its value says which)
        assert torch.equal(part["rollout_versions"][real], part["responses"][real] - VERSION_TOKEN)
        assert sorted(set(part["rollout_versions"][real].tolist())) == ([0, 1, 2] if PROMPTS[r] else [])
