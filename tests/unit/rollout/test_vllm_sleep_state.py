"""The colocated sleep / weight-sync / wake sequence on GPU, against a fake vLLM engine (no GPU, no vLLM).

The fake models what vLLM 0.33's sleep mode does to device memory: level 1 offloads the weights to
host memory and copies them back on wake-up; level 2 discards them, and waking maps fresh memory
whose content is garbage (`GARBAGE`). Writing weights into memory that is asleep, or generating
before every pool is awake, is an error. The fake engine answers each prompt with one token: the
value of its only weight, so a test reads off which weights served a rollout.
"""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from ballast.balance import MicroBatchMode, MicroBatchPolicy, plan_phase

from ballast.workers.train_loop import UpdateResult
from ballast.protocol import Batch
from ballast.workers import actor_rollout_ref
from ballast.workers.actor_rollout_ref import ActorRolloutRefWorker
from ballast.workers.spec import WeightSyncSpec
from ballast.workers.rollout.base import RolloutConfig, SamplingConfig
from ballast.workers.rollout.vllm_backend import VLLMBackend

GARBAGE = 999
VOCAB = 1000


class FakeModel:
    def __init__(self, engine):
        self.engine = engine

    def load_weights(self, weights):
        if "weights" in self.engine.asleep:
            raise RuntimeError("wrote weights into device memory that is not mapped (asleep)")
        for name, tensor in weights:
            self.engine.weight = int(tensor.item())
        self.engine.events.append("load")


class FakeLLM:
    def __init__(self, **kwargs):
        self.kwargs, self.events, self.asleep = kwargs, [], set()
        self.weight, self.offloaded = 0, None  # what the model directory holds: the actor's start
        worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: FakeModel(self)))
        self._worker = worker
        model_config = SimpleNamespace(get_vocab_size=lambda: VOCAB, max_model_len=256)
        self.llm_engine = SimpleNamespace(model_config=model_config)

    def sleep(self, level):
        self.events.append(f"sleep{level}")
        self.offloaded = self.weight if level == 1 else None
        self.weight = None
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        tags = sorted(self.asleep) if tags is None else list(tags)
        self.events.append("wake:" + ",".join(tags))
        if "weights" in tags:
            self.weight = self.offloaded if self.offloaded is not None else GARBAGE
            self.offloaded = None
        self.asleep -= set(tags)

    def collective_rpc(self, fn, kwargs):
        return [fn(self._worker, **kwargs)]

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")

    def generate(self, prompts, params, use_tqdm=False):
        if self.asleep:
            raise RuntimeError(f"generate while {sorted(self.asleep)} asleep")
        self.events.append("generate")
        completion = SimpleNamespace(token_ids=[self.weight], logprobs=None)
        return [SimpleNamespace(outputs=[completion]) for _ in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    module.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    # An earlier test in the same pytest process (an in-process vLLM engine) may leave the default
    # process group initialised, which would make the backend build a distributed engine: these
    # tests are about the sleep/wake state machine of a single engine.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)


class FakeActor:
    """The FSDP actor as the worker sees it: a version number as its only weight."""

    def __init__(self):
        self.version = 0
        self.parallel = SimpleNamespace(dp_rank=0)

    def iter_full_state_dict(self):
        yield "w", torch.tensor(float(self.version))


def _worker(tmp_path, sleep_level):
    config = RolloutConfig(model_path=str(tmp_path), backend="vllm", device="cuda", free_cache_engine=True,
                           sleep_level=sleep_level, pad_token_id=0,
                           sampling=SamplingConfig(max_response_length=4, eos_token_ids=(2,), do_sample=False))
    worker = ActorRolloutRefWorker(SimpleNamespace(actor_train=SimpleNamespace(ppo_epochs=1), rollout_val_sampling=None,
                                                   weight_sync=WeightSyncSpec()))
    worker.actor = FakeActor()
    worker.rollout = VLLMBackend(config)
    worker.rollout.sleep()  # as init_model: the memory goes to training until the first rollout
    return worker


def _served(worker) -> int:
    """Generate once through the worker and return the token the engine answered with."""
    ids = torch.tensor([[5, 6, 7]])
    prompts = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                     "position_ids": torch.arange(3)[None]})
    out = worker.generate_sequences(prompts).batch
    return int(out.tensors["responses"][0, 0])


def _update_actor(worker, monkeypatch):
    def fake_train_loop(actor, data, plan, spec, prefix, **kwargs):
        actor.version += 1
        return UpdateResult({}, [])

    monkeypatch.setattr(actor_rollout_ref, "run_train_loop", fake_train_loop)
    monkeypatch.setattr(actor_rollout_ref, "mfu_metrics", lambda *args, **kwargs: {})
    plan = plan_phase([3], 1, MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=1))
    worker.update_actor(Batch({"input_ids": torch.zeros(1, 3, dtype=torch.long),
                               "old_log_probs": torch.zeros(1, 3)}), plan)


def test_level2_reloads_weights_after_every_sleep_and_syncs_before_waking_the_cache(fake_vllm, tmp_path, monkeypatch):
    worker = _worker(tmp_path, sleep_level=2)
    engine = worker.rollout.llm
    assert _served(worker) == 0  # first rollout: the weights dropped at start-up come back from the actor
    _update_actor(worker, monkeypatch)
    assert _served(worker) == 1
    assert _served(worker) == 1  # e.g. validation: no actor update, but the level-2 sleep dropped them again
    per_rollout = ["wake:weights", "load", "reset_prefix_cache", "wake:kv_cache", "generate", "sleep2"]
    assert engine.events == ["sleep2"] + per_rollout * 3


def test_level1_wakes_offloaded_weights_and_syncs_only_after_an_update(fake_vllm, tmp_path, monkeypatch):
    worker = _worker(tmp_path, sleep_level=1)
    engine = worker.rollout.llm
    assert _served(worker) == 0
    _update_actor(worker, monkeypatch)
    assert _served(worker) == 1
    assert engine.events == ["sleep1",
                             "wake:weights,kv_cache", "generate", "sleep1",
                             "wake:weights", "load", "reset_prefix_cache", "wake:kv_cache", "generate", "sleep1"]


def test_backend_refuses_to_serve_or_wake_discarded_weights(fake_vllm, tmp_path):
    worker = _worker(tmp_path, sleep_level=2)
    backend = worker.rollout
    assert backend.needs_weights
    with pytest.raises(RuntimeError, match="level-2 sleep"):
        backend.wake_up()
    backend.load_weights(worker.actor.iter_full_state_dict())
    assert not backend.needs_weights
    backend.wake_up()
    assert backend.llm.weight == 0 and not backend.llm.asleep


def test_a_prefix_cache_that_cannot_be_reset_after_a_weight_update_is_an_error(fake_vllm, tmp_path, monkeypatch):
    # with blocks shorter than the prompts, the cache really is hit: keeping it would sample the next
    # rollout's prompt prefixes from the old weights
    worker = _worker(tmp_path, sleep_level=1)
    monkeypatch.setattr(worker.rollout.llm, "reset_prefix_cache", lambda: False)
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache"):
        worker.rollout.load_weights(worker.actor.iter_full_state_dict())
