"""Schema of `actor_rollout_ref.rollout`: generation (vLLM or HF) and the old-log-prob pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ballast.trainer.config.schema.agent import AgentSection, MultiTurnSection
from ballast.trainer.config.schema.choice import choice

# verl's values; both run the one request-level rollout (agent loops; verl deprecated `sync`).
RolloutMode = choice("RolloutMode", __name__, "sync", "async")


@dataclass(frozen=True)
class ValKwargs:
    top_k: int
    """Validation top-k; -1: off."""
    top_p: float
    """Validation nucleus threshold, in (0, 1]."""
    temperature: float
    """Validation temperature (> 0 when `do_sample`; unused when greedy)."""
    n: int
    """Answers per validation prompt; > 1 adds the `@n` metrics and needs `do_sample`."""
    do_sample: bool
    """Sample validation answers; false: greedy."""


@dataclass(frozen=True)
class RolloutSection:
    """Generation settings (a section of the config; the rollout's resolved form is
    `ballast.workers.rollout.RolloutConfig`)."""

    name: str
    """Rollout backend: `vllm` or `hf` (transformers generate)."""
    mode: RolloutMode
    """`sync` or `async` (verl's key): both mean the same rollout, agent loops over request-level
    generation, every sample a conversation that advances concurrently (`single_turn_agent` unless the
    row's `agent_name` or `agent.default_agent_loop` names another; `multi_turn` adds tools)."""
    temperature: float
    """Sampling temperature (> 0 when `do_sample`); the actor's log-probs use the same one."""
    top_k: int
    """Top-k sampling; -1: off."""
    top_p: float
    """Nucleus sampling threshold, in (0, 1]."""
    do_sample: bool
    """Sample; false: greedy decoding."""
    n: int
    """Answers per prompt (the GRPO/RLOO group size)."""
    prompt_length: int
    """Prompt capacity in tokens; at least `data.max_prompt_length`."""
    response_length: int
    """Tokens generated per answer; at least `data.max_response_length`."""
    dtype: str
    """Engine dtype: `auto` (bfloat16 on CUDA, float32 on CPU), `float32`, `bfloat16` or `float16`."""
    gpu_memory_utilization: float
    """Fraction of the GPU's total memory that must be free when vLLM starts (after actor/ref load)."""
    kv_cache_memory_bytes: Optional[int]
    """Fixed vLLM KV-cache size on any device; null: from `gpu_memory_utilization` / `cpu_kv_cache_gib`."""
    cpu_kv_cache_gib: int
    """vLLM KV cache on CPU in GiB, the CPU counterpart of `gpu_memory_utilization`."""
    ignore_eos: bool
    """Always generate `response_length` tokens (benchmarks)."""
    enforce_eager: bool
    """Run vLLM without CUDA graphs."""
    free_cache_engine: bool
    """Release vLLM's KV cache and weights during training on GPU (sleep/wake up)."""
    tensor_model_parallel_size: int
    """vLLM tensor-parallel group size; the rollout data-parallel size is world size / this."""
    nnodes: int
    """Nodes of the separate rollout pool (`trainer.v1.trainer_mode=separate_async`; 0 otherwise)."""
    n_gpus_per_node: int
    """Rollout workers per node of the separate rollout pool (on CPU: worker processes)."""
    max_num_batched_tokens: int
    """vLLM's token budget per scheduler step."""
    max_model_len: Optional[int]
    """vLLM's context length; null: `prompt_length + response_length`."""
    max_num_seqs: int
    """vLLM's most sequences per scheduler step."""
    block_size: Optional[int]
    """vLLM's KV-cache block size in tokens; null: vLLM's default for the attention backend (128 on
    CPU). Prefix caching shares only whole blocks, so blocks shorter than the prompts let the n samples
    of a prompt share its prefill (CPU: a multiple of 32)."""
    enable_chunked_prefill: bool
    """Let vLLM split long prompts over scheduler steps."""
    calculate_log_probs: bool
    """Return the rollout engine's log-probs (logged against the actor's as `training/rollout_*`)."""
    seed: int
    """Base sampling seed; each engine, call and row derives its own from it."""
    log_prob_micro_batch_size_per_gpu: Optional[int]
    """Samples per micro-batch of the actor's old-log-prob pass (static micro-batches)."""
    log_prob_use_dynamic_bsz: bool
    """Token-budget micro-batches for the old-log-prob pass."""
    log_prob_max_token_len_per_gpu: int
    """Dynamic token budget per device of the old-log-prob pass."""
    layered_summon: bool
    """Gather the actor's weights for a weight sync one decoder layer at a time (less memory, more
    collectives) instead of in buckets of up to 256 MB."""
    weight_sync_check: Optional[bool]
    """After every weight sync, check that the rollout engine's log-probs on a fixed probe match the
    actor's, failing the run otherwise; null: on exactly for LoRA runs."""
    weight_sync_check_tolerance: Optional[float]
    """Largest mean absolute log-prob difference the check accepts; null: calibrated at start-up, 4x the
    gap measured with the same weights on both sides (at least 1e-4 in float32, 1e-2 in bfloat16)."""
    val_kwargs: ValKwargs
    """Sampling for validation."""
    multi_turn: MultiTurnSection
    """Tool-calling conversations."""
    agent: AgentSection
    """Agent loops (every rollout runs them; single-turn by default)."""
