"""Turn the validated config + derived sizes into the frozen specs the workers are built from.

This is the only place where config keys meet engine/rollout/worker objects, so the mapping of each
verl key to what it controls can be read in one file. The engine and rollout specs check their own
fields; `build` reports a failed check as a `ConfigError` naming the config key that fed the field.
`ballast.trainer.run.run_plan.plan_run` builds these specs once, before Ray starts, so their errors come
before any worker exists, and the workers are constructed from those same objects.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ballast.engine import EngineConfig, OptimConfig
from ballast.engine.config import LoraSpec, PipelineSpec
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, CriticLossConfig, critic_loss, make_actor_loss
from ballast.trainer.config import BallastConfig, DerivedSizes, role_fsdp, role_precision
from ballast.trainer.config.keys import build
from ballast.trainer.config.loader import ConfigError
from ballast.trainer.config.off_policy import overlap, split_pools
from ballast.trainer.config.pipeline import pipeline_shape
from ballast.trainer.config.schema import OptimSection
from ballast.trainer.run.reward_model import RewardModelRun, reward_model_run
from ballast.trainer.step.reward import OverlongBuffer
from ballast.trainer.step.old_log_probs import OldLogProbSource
from ballast.workers.agent_loop.config import AgentLoopSpec, MultiTurnConfig
from ballast.workers.rollout import RolloutConfig, SamplingConfig
from ballast.workers.spec import ActorRolloutRefSpec, CriticSpec, TrainLoopSpec, WeightSyncSpec
from ballast.workers.sync_check import PROBE_TOKENS

GIB = 1 << 30
# Config prefix of each engine role, and of the model section it loads.
ROLE_PREFIX = {"actor": "actor_rollout_ref.actor", "ref": "actor_rollout_ref.ref", "critic": "critic"}
MODEL_PREFIX = {"actor": "actor_rollout_ref.model", "ref": "actor_rollout_ref.model", "critic": "critic.model"}
ROLLOUT = "actor_rollout_ref.rollout"


@dataclass(frozen=True)
class WorkerSpecs:
    """Everything the worker groups are constructed from; `critic` is None without a critic, `rollout`
    None unless the rollout has a pool of its own (then `actor_rollout_ref` has no rollout role)."""

    actor_rollout_ref: ActorRolloutRefSpec
    critic: Optional[CriticSpec]
    rollout: Optional[ActorRolloutRefSpec] = None
    reward_model: Optional[RewardModelRun] = None  # `reward.reward_model.enable`


def worker_specs(cfg: BallastConfig, sizes: DerivedSizes, total_steps: int,
                 old_log_probs: OldLogProbSource) -> WorkerSpecs:
    """Every worker spec, or the first `ConfigError` (naming a config key) met on the way;
    `old_log_probs` is the run's (`RunPlan.old_log_probs`), whose correction settings the actor loss takes."""
    # The schedule advances once per update call, as verl's: `parameter_sync_step` local updates per step
    # stretch its horizon by the same factor (verl sets optim.total_training_steps = steps x local updates).
    schedule_steps = total_steps * overlap(cfg).local_updates
    trainer = actor_rollout_ref_spec(cfg, sizes, schedule_steps, old_log_probs)
    critic = critic_spec(cfg, sizes, schedule_steps) if sizes.critic is not None else None
    rm = reward_model_run(cfg, sizes.world_size, sizes.max_seq_len_tokens)
    if not split_pools(cfg):
        return WorkerSpecs(trainer, critic, reward_model=rm)
    # The rollout pool gets merged full weights through the object store (an adapter is merged in).
    served = rollout_config(cfg, None)
    rollout = dataclasses.replace(trainer, actor=None, actor_train=None, ref=None, ref_in_actor=False, rollout=served)
    # the weights travel in the rollout's dtype: a bf16 engine needs half the bytes of fp32 masters
    sync = dataclasses.replace(trainer.weight_sync, transfer_dtype=served.dtype)
    return WorkerSpecs(dataclasses.replace(trainer, rollout=None, rollout_val_sampling=None, agent=None,
                                           weight_sync=sync), critic, rollout, rm)


def engine_optim(optim: OptimSection, total_steps: int, prefix: str = "optim") -> OptimConfig:
    """The engine's optimizer spec from the `<prefix>` section (e.g. `critic.optim`)."""
    total = optim.total_training_steps if optim.total_training_steps > 0 else total_steps
    # verl: lr_warmup_steps <= 0 falls back to the ratio; warmup_style (deprecated) overrides lr_scheduler_type.
    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps > 0 else int(optim.lr_warmup_steps_ratio * total)
    schedule_key = "warmup_style" if optim.warmup_style is not None else "lr_scheduler_type"
    keys = {"lr": f"{prefix}.lr", "lr_schedule": f"{prefix}.{schedule_key}",
            "warmup_steps": f"{prefix}.lr_warmup_steps", "min_lr_ratio": f"{prefix}.min_lr_ratio"}
    return build(keys, OptimConfig, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                 lr_schedule=getattr(optim, schedule_key), warmup_steps=warmup, total_steps=total,
                 min_lr_ratio=optim.min_lr_ratio)


def lora_spec(model, prefix: str) -> LoraSpec:
    """The engine's LoRA spec from a model section (`<prefix>.lora_rank`, ...)."""
    keys = {"rank": f"{prefix}.lora_rank", "alpha": f"{prefix}.lora_alpha", "target_modules": f"{prefix}.target_modules",
            "exclude_modules": f"{prefix}.exclude_modules", "adapter_path": f"{prefix}.lora_adapter_path"}
    return build(keys, LoraSpec, rank=model.lora_rank, alpha=model.lora_alpha, target_modules=model.target_modules,
                 exclude_modules=model.exclude_modules, adapter_path=model.lora_adapter_path)


def adapter_rank(lora: LoraSpec) -> int:
    """The largest rank the adapter will have: `lora_rank`, or the rank(s) in an adapter loaded from disk."""
    if lora.adapter_path is None:
        return lora.rank
    with open(os.path.join(lora.adapter_path, "adapter_config.json")) as f:
        saved = json.load(f)
    return max([int(saved.get("r", 0)), *(int(r) for r in (saved.get("rank_pattern") or {}).values())])


def _pipeline_spec(cfg: BallastConfig, role: str) -> PipelineSpec:
    """The role's `megatron` pipeline sizes and `pipeline_schedule` (checked by `derive_sizes` already)."""
    section = {"actor": cfg.actor_rollout_ref.actor, "ref": cfg.actor_rollout_ref.ref, "critic": cfg.critic}[role]
    shape = pipeline_shape(section.megatron, section.pipeline_schedule)
    if shape is None:
        return PipelineSpec()
    return PipelineSpec(shape.pp_size, shape.virtual_stages, str(shape.schedule), shape.microbatch_group_size)


def _engine(cfg: BallastConfig, role: str, model, sp: int, grad_clip: Optional[float], optim) -> EngineConfig:
    prefix, fsdp = ROLE_PREFIX[role], role_fsdp(cfg, role)
    keys = {"device": "trainer.device", "ulysses_sequence_parallel_size": f"{prefix}.ulysses_sequence_parallel_size",
            "grad_clip": f"{prefix}.grad_clip", "model_path": f"{MODEL_PREFIX[role]}.path",
            # what a pipeline does not compose with, named by the key that asked for it
            "use_remove_padding": f"{MODEL_PREFIX[role]}.use_remove_padding", "lora": f"{MODEL_PREFIX[role]}.lora_rank",
            "cpu_offload": f"{prefix}.fsdp_config.offload_policy", "fsdp_size": f"{prefix}.fsdp_config.fsdp_size",
            "precision": f"{prefix}.fsdp_config.mixed_precision.param_dtype"}
    # The reference model never carries the adapter: with LoRA it is the actor's base (ref_in_actor).
    lora = lora_spec(model, MODEL_PREFIX[role]) if role != "ref" else LoraSpec()
    return build(
        keys, EngineConfig, model_path=model.path, role=role, use_remove_padding=model.use_remove_padding,
        ulysses_sequence_parallel_size=sp, device=cfg.trainer.device,
        enable_activation_checkpointing=model.enable_gradient_checkpointing,
        # FSDP2 CPU offload: verl's offload_policy; for the optimizer-less reference also its param_offload.
        cpu_offload=bool(fsdp.offload_policy or (role == "ref" and fsdp.param_offload)),
        reshard_after_forward=fsdp.reshard_after_forward, grad_clip=grad_clip, optim=optim,
        fsdp_size=fsdp.fsdp_size, precision=role_precision(cfg, role),
        trust_remote_code=model.trust_remote_code, lora=lora, pipeline=_pipeline_spec(cfg, role),
    )


def sampling_configs(cfg: BallastConfig) -> Tuple[SamplingConfig, SamplingConfig]:
    """(training sampling, validation sampling) from `actor_rollout_ref.rollout`."""
    r = cfg.actor_rollout_ref.rollout
    keys = {k: f"{ROLLOUT}.{k}" for k in ("temperature", "top_p", "top_k", "seed")}
    train = build({**keys, "max_response_length": f"{ROLLOUT}.response_length"}, SamplingConfig,
                  temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_response_length=r.response_length,
                  do_sample=r.do_sample, ignore_eos=r.ignore_eos, pad_to_max_response_length=True,
                  calculate_log_probs=r.calculate_log_probs, seed=r.seed)
    v = r.val_kwargs
    val_keys = {k: f"{ROLLOUT}.val_kwargs.{k}" for k in ("temperature", "top_p", "top_k")}
    val = build(val_keys, dataclasses.replace, train, temperature=v.temperature if v.do_sample else 1.0,
                top_p=v.top_p, top_k=v.top_k, do_sample=v.do_sample, calculate_log_probs=False)
    return train, val


def rollout_config(cfg: BallastConfig, lora: Optional[LoraSpec] = None) -> RolloutConfig:
    """The rollout's spec; `lora`: the actor's adapter, served next to the base weights unless
    `actor_rollout_ref.model.lora.merge` asks for merged weights."""
    r = cfg.actor_rollout_ref.rollout
    serve = lora is not None and lora.enabled and not cfg.actor_rollout_ref.model.lora.merge
    train, _ = sampling_configs(cfg)
    keys = {k: f"{ROLLOUT}.{k}" for k in ("dtype", "max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size",
                                          "gpu_memory_utilization", "kv_cache_memory_bytes",
                                          "tensor_model_parallel_size", "seed")}
    keys.update(backend=f"{ROLLOUT}.name", device="trainer.device", model_path="actor_rollout_ref.model.path",
                cpu_kv_cache_memory_bytes=f"{ROLLOUT}.cpu_kv_cache_gib")
    return build(
        keys, RolloutConfig, model_path=cfg.actor_rollout_ref.model.path, backend=r.name, sampling=train,
        device=cfg.trainer.device, dtype=r.dtype, enforce_eager=r.enforce_eager,
        max_model_len=r.max_model_len or (r.prompt_length + r.response_length),
        max_num_batched_tokens=r.max_num_batched_tokens, max_num_seqs=r.max_num_seqs, block_size=r.block_size,
        enable_chunked_prefill=r.enable_chunked_prefill, gpu_memory_utilization=r.gpu_memory_utilization,
        # Resolved where the engine runs: with trainer.device=auto the driver cannot know the device.
        cpu_kv_cache_memory_bytes=r.cpu_kv_cache_gib * GIB, free_cache_engine=r.free_cache_engine,
        kv_cache_memory_bytes=r.kv_cache_memory_bytes,
        tensor_model_parallel_size=r.tensor_model_parallel_size,
        max_lora_rank=adapter_rank(lora) if serve else None,
    )


def weight_sync_spec(cfg: BallastConfig, lora: LoraSpec) -> WeightSyncSpec:
    """`rollout.layered_summon` and the weight-sync check (on by default for LoRA runs and for a rollout
    pool of its own, where the weights cross processes and nodes), whose probe must fit the engine's context."""
    r, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    check = r.weight_sync_check if r.weight_sync_check is not None else (lora.enabled or split_pools(cfg))
    if r.weight_sync_check_tolerance is not None and not r.weight_sync_check_tolerance > 0:
        raise ConfigError(f"{ROLLOUT}.weight_sync_check_tolerance={r.weight_sync_check_tolerance} must be > 0")
    # vLLM scores a prompt only with room for one generated token after it
    context = r.max_model_len or (r.prompt_length + r.response_length)
    return WeightSyncSpec(layered=r.layered_summon, check=check, check_tolerance=r.weight_sync_check_tolerance,
                          tokenizer_path=model.tokenizer_path or model.path,
                          probe_max_tokens=min(PROBE_TOKENS, context - 1))


def agent_spec(cfg: BallastConfig) -> AgentLoopSpec:
    """The agent loops' spec: every rollout call runs them, in either rollout.mode (sync and async mean
    the same request-level rollout)."""
    r = cfg.actor_rollout_ref.rollout
    mt = r.multi_turn
    prefix = f"{ROLLOUT}.multi_turn"
    keys = {k: f"{prefix}.{k}" for k in ("max_assistant_turns", "max_user_turns", "max_parallel_calls",
                                           "max_tool_response_length", "tool_response_truncate_side",
                                           "tokenization_sanity_check_mode", "format", "tool_timeout_s")}
    multi_turn = build(keys, MultiTurnConfig, enable=mt.enable, max_assistant_turns=mt.max_assistant_turns,
                       max_user_turns=mt.max_user_turns, tool_config_path=mt.tool_config_path,
                       max_parallel_calls=mt.max_parallel_calls, max_tool_response_length=mt.max_tool_response_length,
                       tool_response_truncate_side=mt.tool_response_truncate_side,
                       tokenization_sanity_check_mode=mt.tokenization_sanity_check_mode, format=mt.format,
                       tool_timeout_s=mt.tool_timeout_s)
    a = r.agent
    default = a.default_agent_loop or ("tool_agent" if mt.enable else "single_turn_agent")
    model = cfg.actor_rollout_ref.model
    keys = {"default_agent_loop": f"{ROLLOUT}.agent.default_agent_loop",
            "max_concurrent_conversations": f"{ROLLOUT}.agent.max_concurrent_conversations",
            "prompt_length": f"{ROLLOUT}.prompt_length"}
    return build(keys, AgentLoopSpec, tokenizer_path=model.tokenizer_path or model.path, prompt_length=r.prompt_length,
                 multi_turn=multi_turn, default_agent_loop=default,
                 agent_loop_config_path=a.agent_loop_config_path,
                 max_concurrent_conversations=a.max_concurrent_conversations)


def agent_loop_names(spec: AgentLoopSpec) -> List[str]:
    """The loops a row's `agent_name` may name: the registered ones and those of `agent_loop_config_path`
    (ConfigError naming that key when the file is unusable)."""
    from ballast.trainer.config import ConfigError
    from ballast.workers.agent_loop.base import load_agent_loop_config, registered_loops

    try:
        return sorted({**registered_loops(), **load_agent_loop_config(spec.agent_loop_config_path)})
    except ValueError as err:
        raise ConfigError(f"{ROLLOUT}.agent.agent_loop_config_path: {err}") from None


def check_agent_files(spec: AgentLoopSpec) -> None:
    """Load the tool yaml and the agent-loop yaml once (ConfigError naming the key on failure)."""
    from ballast.tools import load_tools
    from ballast.trainer.config import ConfigError

    try:
        load_tools(spec.multi_turn.tool_config_path)
    except ValueError as err:
        raise ConfigError(f"{ROLLOUT}.multi_turn.tool_config_path: {err}") from None
    loops = agent_loop_names(spec)
    if spec.default_agent_loop not in loops:
        raise ConfigError(f"{ROLLOUT}.agent.default_agent_loop={spec.default_agent_loop!r} is not an agent loop; "
                          f"registered: {loops}")


def actor_loss_config(cfg: BallastConfig, old_log_probs: OldLogProbSource) -> ActorLossConfig:
    """The actor loss's settings: the actor's keys, and the rollout correction the run's old-log-prob
    source parsed (`old_log_probs.loss_correction`)."""
    a = cfg.actor_rollout_ref.actor
    return ActorLossConfig(
        loss_mode=a.policy_loss.loss_mode, clip_ratio_low=a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio,
        clip_ratio_high=a.clip_ratio_high if a.clip_ratio_high is not None else a.clip_ratio,
        clip_ratio_c=a.clip_ratio_c, loss_agg_mode=str(a.loss_agg_mode), loss_scale_factor=a.loss_scale_factor,
        entropy_coeff=a.entropy_coeff,
        use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type,
        rollout_correction=old_log_probs.loss_correction,
    )


def actor_rollout_ref_spec(cfg: BallastConfig, sizes: DerivedSizes, schedule_steps: int,
                           old_log_probs: OldLogProbSource) -> ActorRolloutRefSpec:
    arr = cfg.actor_rollout_ref
    actor = arr.actor
    temperature = arr.rollout.temperature if arr.rollout.do_sample else 1.0
    actor_engine = _engine(cfg, "actor", arr.model, sizes.actor.sp_size, actor.grad_clip,
                           engine_optim(actor.optim, schedule_steps, "actor_rollout_ref.actor.optim"))
    train = TrainLoopSpec(
        loss_fn=make_actor_loss(actor_loss_config(cfg, old_log_probs)), temperature=temperature,
        calculate_entropy=actor.entropy_coeff > 0 or actor.calculate_entropy,
        grad_clip_min_batch_size=actor.grad_clip_min_batch_size if actor.grad_clip_adaptive else None,
    )
    ref_engine = None
    ref_in_actor = sizes.ref is not None and actor_engine.lora.enabled  # verl: the actor without its adapter
    if sizes.ref is not None and not ref_in_actor:
        ref_engine = _engine(cfg, "ref", arr.model, sizes.ref.sp_size, None, OptimConfig(lr=0.0))
    _, val_sampling = sampling_configs(cfg)
    rollout = rollout_config(cfg, actor_engine.lora)
    agent = agent_spec(cfg)
    check_agent_files(agent)
    return ActorRolloutRefSpec(
        actor=actor_engine, actor_train=train, rollout=rollout,
        rollout_val_sampling=val_sampling, ref=ref_engine, temperature=temperature,
        seed=cfg.trainer.seed, dist_timeout_s=cfg.trainer.worker_timeout_s, ref_in_actor=ref_in_actor,
        weight_sync=weight_sync_spec(cfg, actor_engine.lora), agent=agent,
    )


def critic_spec(cfg: BallastConfig, sizes: DerivedSizes, schedule_steps: int) -> CriticSpec:
    c = cfg.critic
    engine = _engine(cfg, "critic", c.model, sizes.critic.sp_size, c.grad_clip,
                     engine_optim(c.optim, schedule_steps, "critic.optim"))
    loss = functools.partial(critic_loss, cfg=CriticLossConfig(cliprange_value=c.cliprange_value,
                                                               loss_agg_mode=str(c.loss_agg_mode),
                                                               loss_scale_factor=c.loss_scale_factor))
    train = TrainLoopSpec(loss_fn=loss)
    return CriticSpec(critic=engine, train=train, seed=cfg.trainer.seed,
                      dist_timeout_s=cfg.trainer.worker_timeout_s)


def overlong_buffer(cfg: BallastConfig) -> Optional[OverlongBuffer]:
    """DAPO's overlong reward shaping (`reward_model.overlong_buffer`), or None when off."""
    ob = cfg.reward_model.overlong_buffer
    if not ob.enable:
        return None
    return OverlongBuffer(max_response_length=cfg.data.max_response_length, buffer_len=ob.len,
                          penalty_factor=ob.penalty_factor, log=ob.log)
