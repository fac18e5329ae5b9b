"""Rollout TP on GPU where every Ray worker sees one device: vLLM's peer-memory all-reduce paths off.

Simulated on CPU: `CUDA_VISIBLE_DEVICES` holds the single entry Ray gives a GPU actor, the rollout is
configured for CUDA with TP=2 under the external launcher, and the engine arguments (and, through a
stand-in `vllm` module, the environment the engine is built in) are checked.
"""

from __future__ import annotations

import os
import sys
import types

import pytest

from ballast.workers.rollout import vllm_backend
from ballast.workers.rollout.base import RolloutConfig, SamplingConfig
from ballast.workers.rollout.single_device_tp import PEER_ALL_REDUCE_ENV, tp_peers_hidden, visible_cuda_devices
from ballast.workers.rollout.vllm_backend import VLLMBackend, engine_kwargs


def _gpu_tp(tp: int) -> RolloutConfig:
    return RolloutConfig(model_path="/models/x", device="cuda", tensor_model_parallel_size=tp,
                         sampling=SamplingConfig(eos_token_ids=(2,)), pad_token_id=0)


def test_ray_gpu_actor_with_tp2_disables_custom_and_flashinfer_all_reduce(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # what Ray sets for the actor holding GPU 5
    kw = engine_kwargs(_gpu_tp(2), distributed=True)
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "external_launcher"
    assert kw["disable_custom_all_reduce"] is True
    assert kw["compilation_config"] == {"pass_config": {"fuse_allreduce_rms": False}}


@pytest.mark.parametrize("visible, tp, distributed, device", [
    ("4,5", 2, True, "cuda"),     # both peers' GPUs visible (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES)
    ("5", 1, True, "cuda"),       # no TP peers
    ("5", 2, True, "cpu"),        # vLLM's CPU path has no custom all-reduce
])
def test_layouts_where_peers_see_each_other_keep_vllms_defaults(monkeypatch, visible, tp, distributed, device):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cfg = RolloutConfig(model_path="/models/x", device=device, tensor_model_parallel_size=tp)
    kw = engine_kwargs(cfg, distributed=distributed)
    assert "disable_custom_all_reduce" not in kw and "compilation_config" not in kw


def test_visible_devices_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 7")
    assert visible_cuda_devices() == 2
    assert tp_peers_hidden(True, True, 4) and not tp_peers_hidden(True, True, 2)
    assert tp_peers_hidden(True, True, 2, visible=1) and not tp_peers_hidden(True, False, 2, visible=1)


def test_the_engine_is_built_with_those_arguments_and_the_flashinfer_switches_off(monkeypatch):
    """VLLMBackend on a simulated GPU TP=2 worker: vLLM's `LLM` (a stand-in) receives the arguments
    and sees the all-reduce environment switches already set when it is constructed."""
    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen["kwargs"] = kwargs
            seen["env"] = {key: os.environ.get(key) for key in PEER_ALL_REDUCE_ENV}
            model_config = types.SimpleNamespace(get_vocab_size=lambda: 128, max_model_len=256)
            self.llm_engine = types.SimpleNamespace(model_config=model_config)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setattr(vllm_backend, "_check_launch_env", lambda config: True)  # the external-launcher world
    monkeypatch.setattr(vllm_backend, "resolve_special_tokens", lambda config: ((2,), 0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    for key in PEER_ALL_REDUCE_ENV:
        monkeypatch.setenv(key, "1")  # vLLM's defaults: on
    VLLMBackend(_gpu_tp(2))
    assert seen["kwargs"]["disable_custom_all_reduce"] is True
    assert seen["env"] == {"VLLM_ALLREDUCE_USE_FLASHINFER": "0", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
