"""The colocated sleep / weight-sync / wake sequence on GPU, against a fake vLLM engine (no GPU, no vLLM).

The fake models what vLLM 0.33's sleep mode does to device memory: level 1 offloads the weights to
host memory and copies them back on wake-up; level 2 discards them, and waking maps fresh memory
whose content is garbage (`GARBAGE`). The LoRA buffers live in the "runtime" pool, which every sleep
offloads and every wake-up (whatever its tags) maps back with the pre-sleep contents. Writing weights
or an adapter into memory that is asleep, or generating before every pool is awake, is an error (a
lenient fake accepts the adapter write instead, into memory the next wake-up overwrites). The fake
engine answers each prompt with one token, the value of its only weight, and under an adapter with a
second one, `ADAPTER_TOKEN` + the adapter's value, so a test reads off what served a rollout.
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
from ballast.workers.agent_loop import AgentLoopRunner
from ballast.workers.spec import GenerateArgs, WeightSyncSpec
from ballast.workers.rollout.faults import FaultState
from ballast.workers.weight_sources import ColocatedActorWeights
from ballast.workers.rollout.base import RolloutConfig, SamplingConfig
from ballast.workers.rollout import vllm_backend
from ballast.workers.rollout.vllm_backend import VLLMBackend

GARBAGE = 999
VOCAB = 1000
ADAPTER_TOKEN = 500


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
    lenient_adapter_writes = False  # True: an adapter written while asleep lands in unmapped memory, no fault

    def __init__(self, **kwargs):
        self.kwargs, self.events, self.asleep = kwargs, [], set()
        self.weight, self.offloaded = 0, None  # what the model directory holds: the actor's start
        self.adapter, self.offloaded_adapter = None, None  # the runtime pool's LoRA buffers: (id, value)
        worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: FakeModel(self)), engine=self)
        self._worker = worker
        self.llm_engine = FakeEngine(self)

    def sleep(self, level):
        self.events.append(f"sleep{level}")
        self.offloaded = self.weight if level == 1 else None
        self.offloaded_adapter = self.adapter  # the runtime pool is kept at every level
        self.weight = self.adapter = None
        self.asleep = {"weights", "kv_cache", "runtime"}

    def wake_up(self, tags=None):
        tags = sorted(self.asleep - {"runtime"}) if tags is None else list(tags)
        self.events.append("wake:" + ",".join(tags))
        if "weights" in tags:
            self.weight = self.offloaded if self.offloaded is not None else GARBAGE
            self.offloaded = None
        if "runtime" in self.asleep:  # not deferrable: every wake-up maps it back, pre-sleep contents in
            self.adapter, self.offloaded_adapter = self.offloaded_adapter, None
        self.asleep -= {*tags, "runtime"}

    def install_adapter(self, lora_id, value):
        """What `vllm_lora.install_adapter` does to device memory: copy the adapter into the LoRA buffers."""
        if "runtime" in self.asleep and not self.lenient_adapter_writes:
            raise RuntimeError("copied an adapter into LoRA buffers that are not mapped (asleep)")
        self.adapter = (lora_id, value)
        self.events.append(f"adapter{lora_id}")

    def collective_rpc(self, fn, args=(), kwargs=None):
        return [fn(self._worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")

    def _preprocess_cmpl_one(self, prompt):
        return prompt


class FakeEngine:
    """The request-level face of the fake engine: every request finishes in the step after its add."""

    def __init__(self, llm):
        self.llm, self.requests = llm, []
        self.model_config = SimpleNamespace(get_vocab_size=lambda: VOCAB, max_model_len=256)

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.requests.append((request_id, lora_request))

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        llm = self.llm
        if llm.asleep:
            raise RuntimeError(f"generate while {sorted(llm.asleep)} asleep")
        llm.events.append("generate")
        outputs = []
        for request_id, lora_request in self.requests:
            tokens = [llm.weight]
            if lora_request is not None:
                installed, value = llm.adapter or (None, None)
                if installed != lora_request.lora_int_id:
                    raise RuntimeError(f"request names adapter {lora_request.lora_int_id}, loaded: {installed}")
                tokens.append(ADAPTER_TOKEN + value)
            completion = SimpleNamespace(token_ids=tokens, logprobs=None)
            outputs.append(SimpleNamespace(request_id=request_id, finished=True, outputs=[completion]))
        self.requests = []
        return outputs


def _fake_install_adapter(worker, tensors, peft_config, lora_id):
    worker.engine.install_adapter(lora_id, int(tensors["lora_B"].item()))
    return [lora_id]


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    module.inputs = inputs
    sampling_params = types.ModuleType("vllm.sampling_params")
    sampling_params.RequestOutputKind = SimpleNamespace(DELTA="delta", FINAL_ONLY="final")
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling_params)
    lora_request = types.ModuleType("vllm.lora.request")
    lora_request.LoRARequest = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora_request)
    # vLLM's model registry and adapter manager are not faked: the architecture serves LoRA, and the
    # install goes to the fake engine's LoRA buffers
    monkeypatch.setattr(vllm_backend, "architecture_serves_lora", lambda path: (True, ""))
    monkeypatch.setattr(vllm_backend, "install_adapter", _fake_install_adapter)
    # An earlier test in the same pytest process (an in-process vLLM engine) may leave the default
    # process group initialised, which would make the backend build a distributed engine: these
    # tests are about the sleep/wake state machine of a single engine.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)


class FakeActor:
    """The FSDP actor as the worker sees it: a version number as its only weight."""

    adapter = None

    def __init__(self):
        self.version = 0
        self.parallel = SimpleNamespace(dp_rank=0)

    def iter_full_state_dict(self):
        yield "w", torch.tensor(float(self.version))


class FakeLoraActor(FakeActor):
    """A LoRA actor: a frozen base weight (0) and an adapter whose only tensor is the version number."""

    adapter = SimpleNamespace(max_rank=8, config_dict=lambda: {"r": 8, "lora_alpha": 16})

    def iter_base_state_dict(self, layered=False):
        yield "w", torch.tensor(0.0)

    def iter_adapter_state_dict(self, layered=False):
        yield "lora_B", torch.tensor(float(self.version))


def _worker(tmp_path, sleep_level, actor=None):
    config = RolloutConfig(model_path=str(tmp_path), backend="vllm", device="cuda", free_cache_engine=True,
                           sleep_level=sleep_level, pad_token_id=0,
                           max_lora_rank=8 if isinstance(actor, FakeLoraActor) else None,
                           sampling=SamplingConfig(max_response_length=4, eos_token_ids=(2,), do_sample=False))
    worker = ActorRolloutRefWorker(SimpleNamespace(actor_train=SimpleNamespace(ppo_epochs=1), rollout_val_sampling=None,
                                                   weight_sync=WeightSyncSpec()))
    worker.actor = actor or FakeActor()
    worker.rollout = VLLMBackend(config)
    worker._agents = AgentLoopRunner(worker.rollout)
    worker._faults, worker._tp_group = FaultState(0, {}), None
    worker._weights = ColocatedActorWeights(worker.rollout, worker.actor, worker.spec.weight_sync)
    worker._weights.start()  # as init_model: the memory goes to training until the first rollout
    return worker


def _response(worker) -> list[int]:
    """Generate once through the worker and return the tokens the engine answered with."""
    ids = torch.tensor([[5, 6, 7]])
    prompts = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                     "position_ids": torch.arange(3)[None]})
    out = worker.generate_sequences(prompts, GenerateArgs()).batch
    return [int(t) for t, kept in zip(out.tensors["responses"][0], out.tensors["response_mask"][0]) if kept]


def _served(worker) -> int:
    """The weight that served one rollout through the worker."""
    return _response(worker)[0]


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


@pytest.mark.parametrize("lenient", [False, True], ids=["unmapped-write-faults", "wake-restores-old-adapter"])
def test_level1_lora_installs_each_adapter_into_awake_memory(fake_vllm, tmp_path, monkeypatch, lenient):
    """Colocated LoRA: the adapter goes in after the weights (and the runtime pool with them) are awake.
    Installed into the sleeping engine, its copy hits unmapped memory (the first generate fails) or, where
    that does not fault, the wake-up restores the pre-sleep adapter over it (the rollout samples from the
    previous adapter)."""
    monkeypatch.setattr(FakeLLM, "lenient_adapter_writes", lenient)
    worker = _worker(tmp_path, sleep_level=1, actor=FakeLoraActor())
    engine = worker.rollout.llm
    assert _response(worker) == [0, ADAPTER_TOKEN + 0]  # the base weights under the actor's first adapter
    _update_actor(worker, monkeypatch)
    assert _response(worker) == [0, ADAPTER_TOKEN + 1]
    assert _response(worker) == [0, ADAPTER_TOKEN + 1]  # no update: the adapter survives a sleep and a wake
    per_sync = ["wake:weights", "adapter{}", "reset_prefix_cache", "wake:kv_cache", "generate", "sleep1"]
    no_sync = ["wake:weights,kv_cache", "generate", "sleep1"]
    expected = ["sleep1"] + [e.format(1) for e in per_sync] + [e.format(2) for e in per_sync] + no_sync
    assert engine.events == expected


def test_level2_lora_reloads_the_base_weights_then_the_adapter(fake_vllm, tmp_path, monkeypatch):
    worker = _worker(tmp_path, sleep_level=2, actor=FakeLoraActor())
    engine = worker.rollout.llm
    assert _response(worker) == [0, ADAPTER_TOKEN + 0]
    _update_actor(worker, monkeypatch)
    assert _response(worker) == [0, ADAPTER_TOKEN + 1]
    assert engine.events[:7] == ["sleep2", "wake:weights", "load", "reset_prefix_cache", "adapter1",
                                 "reset_prefix_cache", "wake:kv_cache"]
