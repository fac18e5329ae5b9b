"""Per-rank batch sizes derived once from the config and the world layout, frozen.

Workers and the driver read sizes from here; nobody divides config values in place (verl's workers
rewrite `ppo_mini_batch_size` during init, which makes the same key mean different things in
different places). Every impossible combination raises `ConfigError` naming the keys and numbers.

    samples_per_step            = data.train_batch_size * rollout.n
    dp_size (actor)             = world_size // (actor.ulysses_sequence_parallel_size
                                                 * actor.megatron.pipeline_model_parallel_size)
    rollout_dp                  = rollout world // rollout.tensor_model_parallel_size
                                  (rollout world: world_size, or the rollout pool under separate_async)
    mini_batch_samples          = actor.ppo_mini_batch_size * rollout.n            (global)
    mini_batch_samples_per_rank = mini_batch_samples // dp_size
    grad_accum_steps            = mini_batch_samples_per_rank // ppo_micro_batch_size_per_gpu (static)
    micro_token_budget          = ppo_max_token_len_per_gpu * ulysses_sequence_parallel_size  (dynamic)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence

from ballast.trainer.config.keys import build
from ballast.trainer.config.loader import ConfigError
from ballast.trainer.config.model_info import ModelInfo
from ballast.trainer.config.off_policy import SYNC_STEP_KEY, overlap, split_pools
from ballast.trainer.config.pipeline import role_pipeline
from ballast.trainer.config.schema import BallastConfig

if TYPE_CHECKING:
    from ballast.balance import MicroBatchPolicy, PipelineCostModel
    from ballast.engine import MicroBatchSpec


@dataclass(frozen=True)
class RoleSizes:
    """One role's per-rank sizes; `infer` and `train` are the engine's own micro-batch specs, handed
    to the workers as they are."""

    dp_size: int
    sp_size: int
    samples_per_rank: int
    infer: MicroBatchSpec
    # Training roles only (the reference model never trains).
    mini_batch_samples: Optional[int] = None
    mini_batch_samples_per_rank: Optional[int] = None
    num_mini_batches: Optional[int] = None
    grad_accum_steps: Optional[int] = None
    train: Optional[MicroBatchSpec] = None
    # Pipeline parallelism (`<role>.megatron`): ranks per pipeline and the planner's cost model.
    pp_size: int = 1
    pipeline: Optional[PipelineCostModel] = None

    def token_budget(self, micro: MicroBatchSpec) -> Optional[int]:
        """Real tokens one micro-batch of `micro` may hold on this role's SP group; None when static."""
        return micro.token_budget(self.sp_size) if micro.use_dynamic_bsz else None

    def policy(self, micro: MicroBatchSpec) -> MicroBatchPolicy:
        """The planner's policy for `micro`: the SP group's budget, and with a pipeline its cost model
        (fixed slots, the schedule's counts, the planned order)."""
        import dataclasses

        policy = micro.policy(self.sp_size)
        return policy if self.pipeline is None else dataclasses.replace(policy, pipeline=self.pipeline)


@dataclass(frozen=True)
class DerivedSizes:
    world_size: int
    samples_per_step: int
    max_seq_len_tokens: int
    rollout_tp: int
    rollout_dp: int
    rollout_samples_per_rank: int
    use_critic: bool
    use_reference: bool
    actor: RoleSizes
    ref: Optional[RoleSizes]
    critic: Optional[RoleSizes]

    def summary(self) -> List[str]:
        lines = [
            f"world_size={self.world_size} samples_per_step={self.samples_per_step} "
            f"max_seq_len_tokens={self.max_seq_len_tokens}",
            f"rollout: tp={self.rollout_tp} dp={self.rollout_dp} samples_per_rank={self.rollout_samples_per_rank}",
        ]
        for name in ("actor", "ref", "critic"):
            role: Optional[RoleSizes] = getattr(self, name)
            if role is None:
                continue
            line = f"{name}: dp={role.dp_size} sp={role.sp_size} samples_per_rank={role.samples_per_rank}"
            if role.pipeline is not None:
                shape = role.pipeline.shape
                line += (f" pp={shape.pp_size} v={shape.virtual_stages} schedule={shape.schedule}"
                         f" stage_layers={list(role.pipeline.stage_layers)}")
            if role.train is not None:
                line += (
                    f" mini_batch_samples={role.mini_batch_samples} per_rank={role.mini_batch_samples_per_rank}"
                    f" num_mini_batches={role.num_mini_batches}"
                    f" train={_describe(role.train, role.grad_accum_steps, role.token_budget(role.train))}"
                )
            line += f" infer={_describe(role.infer, None, role.token_budget(role.infer))}"
            lines.append(line)
        return lines


def _describe(mb: MicroBatchSpec, grad_accum_steps: Optional[int], budget: Optional[int]) -> str:
    if mb.use_dynamic_bsz:
        return f"dynamic(budget={budget} tokens/micro-batch)"
    text = f"static({mb.micro_batch_size_per_gpu}/micro-batch"
    return text + (f", grad_accum={grad_accum_steps})" if grad_accum_steps else ")")


def uses_critic(cfg: BallastConfig) -> bool:
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return cfg.algorithm.adv_estimator == "gae"


def uses_reference(cfg: BallastConfig) -> bool:
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def actor_uses_lora(cfg: BallastConfig) -> bool:
    """verl's rule: a LoRA actor (`lora_rank > 0` or an adapter to start from), whose reference policy is
    then the actor itself with the adapter switched off (no second copy of the weights)."""
    model = cfg.actor_rollout_ref.model
    return model.lora_rank > 0 or model.lora_adapter_path is not None


def derive_sizes(cfg: BallastConfig, model: Optional[ModelInfo] = None) -> DerivedSizes:
    """Compute every per-rank size, raising `ConfigError` for the first impossible combination."""
    trainer, data = cfg.trainer, cfg.data
    rollout, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    world = trainer.nnodes * trainer.n_gpus_per_node
    n = rollout.n
    samples = data.train_batch_size * n
    max_seq = data.max_prompt_length + data.max_response_length

    tp = rollout.tensor_model_parallel_size
    rollout_dp = _rollout_dp(cfg, rollout_world_size(cfg), model)

    prefix = "actor_rollout_ref.actor"
    sp = _sp_size(prefix, actor.ulysses_sequence_parallel_size, world, model)
    # Length buckets split the actor's dynamic micro-batches: always in training, in the old-log-prob
    # pass when that is dynamic as well.
    buckets = actor.bucket_boundaries if actor.dynamic_bsz_bucketing else None
    arr_model = cfg.actor_rollout_ref.model
    shares = {"actor_rollout_ref.actor.use_prefix_grouper": actor.use_prefix_grouper}
    pipeline = role_pipeline(prefix, actor, world, sp, model, remove_padding_key="actor_rollout_ref.model.use_remove_padding",
                             remove_padding=arr_model.use_remove_padding,
                             conflicts={**shares, "actor_rollout_ref.actor.dynamic_bsz_bucketing": actor.dynamic_bsz_bucketing})
    actor_sizes = _train_role(
        prefix, world, samples, n, sp, actor.ppo_mini_batch_size, data.train_batch_size, pipeline=pipeline,
        train=_micro(prefix, actor.use_dynamic_bsz, actor.ppo_micro_batch_size_per_gpu,
                     actor.ppo_max_token_len_per_gpu, sp, max_seq, _TRAIN_KEYS, buckets),
        infer=_micro("actor_rollout_ref.rollout", rollout.log_prob_use_dynamic_bsz,
                     rollout.log_prob_micro_batch_size_per_gpu, rollout.log_prob_max_token_len_per_gpu, sp, max_seq,
                     buckets=buckets if rollout.log_prob_use_dynamic_bsz else None),
    )

    ref_sizes = None
    if uses_reference(cfg):
        prefix, ref = "actor_rollout_ref.ref", cfg.actor_rollout_ref.ref
        sp = _sp_size(prefix, ref.ulysses_sequence_parallel_size, world, model)
        if actor_uses_lora(cfg) and sp != actor_sizes.sp_size:
            raise ConfigError(
                f"{prefix}.ulysses_sequence_parallel_size={sp} differs from actor_rollout_ref.actor."
                f"ulysses_sequence_parallel_size={actor_sizes.sp_size}: with LoRA the reference log-probs come from "
                "the actor's engine (adapter switched off), on the actor's mesh")
        pipeline = role_pipeline(prefix, ref, world, sp, model, remove_padding_key="actor_rollout_ref.model.use_remove_padding",
                                 remove_padding=arr_model.use_remove_padding, conflicts=shares)
        pp = 1 if pipeline is None else pipeline.shape.pp_size
        dp = world // (sp * pp)
        _divides(dp, samples, f"{prefix} dp size (world // ({prefix}.ulysses_sequence_parallel_size x "
                 f"{prefix}.megatron.pipeline_model_parallel_size))", _SAMPLES)
        ref_sizes = RoleSizes(dp, sp, samples // dp, _micro(
            prefix, ref.log_prob_use_dynamic_bsz, ref.log_prob_micro_batch_size_per_gpu,
            ref.log_prob_max_token_len_per_gpu, sp, max_seq), pp_size=pp, pipeline=pipeline)

    if actor.use_prefix_grouper:
        _check_shared_prompts(cfg, actor_sizes, ref_sizes)

    critic_sizes = None
    if uses_critic(cfg):
        prefix, critic = "critic", cfg.critic
        sp = _sp_size(prefix, critic.ulysses_sequence_parallel_size, world, model)
        critic_model = model
        if model is not None and critic.model.path != arr_model.path:
            critic_model = ModelInfo.from_dir(critic.model.path, "critic.model.path")
        pipeline = role_pipeline(prefix, critic, world, sp, critic_model, remove_padding_key="critic.model.use_remove_padding",
                                 remove_padding=critic.model.use_remove_padding, conflicts={})
        critic_sizes = _train_role(
            prefix, world, samples, n, sp, critic.ppo_mini_batch_size, data.train_batch_size, pipeline=pipeline,
            train=_micro(prefix, critic.use_dynamic_bsz, critic.ppo_micro_batch_size_per_gpu,
                         critic.ppo_max_token_len_per_gpu, sp, max_seq, _TRAIN_KEYS),
            infer=_micro(prefix, critic.use_dynamic_bsz, critic.forward_micro_batch_size_per_gpu,
                         critic.forward_max_token_len_per_gpu, sp, max_seq,
                         ("forward_micro_batch_size_per_gpu", "forward_max_token_len_per_gpu", "use_dynamic_bsz")),
        )
        local = overlap(cfg).local_updates
        if local > 1:  # each local update trains the critic on its own share of the prompts
            _divides(critic.ppo_mini_batch_size, data.train_batch_size // local, "critic.ppo_mini_batch_size",
                     f"the prompts of each local update ({SYNC_STEP_KEY}={local}): data.train_batch_size / {local}")
    return DerivedSizes(
        world_size=world, samples_per_step=samples, max_seq_len_tokens=max_seq, rollout_tp=tp,
        rollout_dp=rollout_dp, rollout_samples_per_rank=samples // rollout_dp, use_critic=critic_sizes is not None,
        use_reference=ref_sizes is not None, actor=actor_sizes, ref=ref_sizes, critic=critic_sizes,
    )


_SHARE = "actor_rollout_ref.actor.use_prefix_grouper=True"


def _check_shared_prompts(cfg: BallastConfig, actor: RoleSizes, ref: Optional[RoleSizes]) -> None:
    """What running each prompt once for its samples needs: the packed layout, no Ulysses, whole
    prompts per rank and per micro-batch, and the worst-case group within every token budget."""
    arr, n = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout.n
    if not arr.model.use_remove_padding:
        raise ConfigError(f"{_SHARE} runs in the packed layout: set actor_rollout_ref.model.use_remove_padding=True")
    roles = [("actor_rollout_ref.actor", actor, (("actor_rollout_ref.actor", _TRAIN_KEYS, actor.train),
                                                 ("actor_rollout_ref.rollout", _LOG_PROB_KEYS, actor.infer)))]
    if ref is not None:
        roles.append(("actor_rollout_ref.ref", ref, (("actor_rollout_ref.ref", _LOG_PROB_KEYS, ref.infer),)))
    group = cfg.data.max_prompt_length + n * cfg.data.max_response_length
    for prefix, sizes, specs in roles:
        if sizes.sp_size > 1:
            raise ConfigError(f"{_SHARE} does not run under Ulysses: {prefix}.ulysses_sequence_parallel_size="
                              f"{sizes.sp_size} must be 1")
        _divides(sizes.dp_size, cfg.data.train_batch_size, f"{prefix} dp size (a prompt's samples stay on one rank)",
                 "data.train_batch_size")
        if sizes.mini_batch_samples is not None:
            _divides(sizes.dp_size, sizes.mini_batch_samples // n, f"{prefix} dp size (a prompt's samples stay on "
                     "one rank)", f"{prefix}.ppo_mini_batch_size")
        for key_prefix, (micro_key, tokens_key, _), spec in specs:
            if not spec.use_dynamic_bsz and spec.micro_batch_size_per_gpu % n:
                raise ConfigError(f"{_SHARE} keeps a prompt's samples in one micro-batch: {key_prefix}.{micro_key}="
                                  f"{spec.micro_batch_size_per_gpu} must be a multiple of actor_rollout_ref.rollout.n={n}")
            if spec.use_dynamic_bsz and spec.token_budget(1) < group:
                raise ConfigError(
                    f"{_SHARE} keeps a prompt's samples in one micro-batch: {key_prefix}.{tokens_key}="
                    f"{spec.token_budget(1)} is smaller than a whole group, data.max_prompt_length + "
                    f"rollout.n * data.max_response_length = {cfg.data.max_prompt_length} + {n} * "
                    f"{cfg.data.max_response_length} = {group} tokens (raise it, or set "
                    "actor_rollout_ref.actor.use_prefix_grouper=False)")


_WORLD = "world size (trainer.nnodes * trainer.n_gpus_per_node)"
_SAMPLES = "data.train_batch_size * actor_rollout_ref.rollout.n"


def rollout_world_size(cfg: BallastConfig) -> int:
    """Processes that run the rollout: the trainer's (colocated) or the rollout pool's (separate_async)."""
    if split_pools(cfg):
        return cfg.actor_rollout_ref.rollout.nnodes * cfg.actor_rollout_ref.rollout.n_gpus_per_node
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def _rollout_dp(cfg: BallastConfig, world: int, model: Optional[ModelInfo]) -> int:
    """Rollout workers (rollout world // tensor-parallel size); every generation batch divides over them."""
    rollout = cfg.actor_rollout_ref.rollout
    tp, n = rollout.tensor_model_parallel_size, rollout.n
    tp_key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    if tp < 1:
        raise ConfigError(f"{tp_key}={tp} must be >= 1")
    _divides(tp, world, tp_key, "rollout pool size (actor_rollout_ref.rollout.nnodes * n_gpus_per_node)"
             if split_pools(cfg) else _WORLD)
    if model is not None:
        _divides(tp, model.num_attention_heads, tp_key, "the model's num_attention_heads")
    rollout_dp = world // tp
    _divides(rollout_dp, cfg.data.train_batch_size * n, f"rollout dp size (world // {tp_key})", _SAMPLES)
    gen = cfg.data.gen_batch_size
    if gen is not None and gen * n % rollout_dp:
        raise ConfigError(f"data.gen_batch_size * actor_rollout_ref.rollout.n = {gen * n} "
                          f"samples must divide over the {rollout_dp} rollout workers")
    return rollout_dp


def _divides(divisor: int, value: int, divisor_name: str, value_name: str) -> None:
    if divisor <= 0 or value % divisor != 0:
        raise ConfigError(f"{value_name}={value} is not divisible by {divisor_name}={divisor}")


def _sp_size(prefix: str, sp: int, world: int, model: Optional[ModelInfo]) -> int:
    key = f"{prefix}.ulysses_sequence_parallel_size"
    if sp < 1:
        raise ConfigError(f"{key}={sp} must be >= 1")
    _divides(sp, world, key, _WORLD)
    if model is not None and model.num_attention_heads % sp:
        # Ulysses splits attention heads over the sp ranks; KV heads are repeated when they do not split.
        raise ConfigError(
            f"the model's num_attention_heads={model.num_attention_heads} is not divisible by {key}={sp} "
            f"(the model has {model.num_attention_heads} attention heads and {model.num_key_value_heads} KV heads; "
            f"choose an sp size that divides {model.num_attention_heads})"
        )
    return sp


# (micro-batch size, token budget, dynamic switch) keys of a role's micro-batching, after its prefix.
_TRAIN_KEYS = ("ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", "use_dynamic_bsz")
_LOG_PROB_KEYS = ("log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu", "log_prob_use_dynamic_bsz")


def _micro(prefix: str, dynamic: bool, micro: Optional[int], max_tokens: int, sp: int, max_seq: int,
           keys: Sequence[str] = _LOG_PROB_KEYS, buckets: Optional[Sequence[int]] = None) -> MicroBatchSpec:
    """One role's micro-batch spec for one kind of call (the engine checks it); the hard token cap
    must also hold a full sample."""
    from ballast.engine import MicroBatchSpec

    micro_key, tokens_key, dynamic_key = keys
    spec_keys = {
        "micro_batch_size_per_gpu": f"{prefix}.{micro_key}", "max_token_len_per_gpu": f"{prefix}.{tokens_key}",
        "bucket_boundaries": "actor_rollout_ref.actor.bucket_boundaries",
        # The spec's one rule on use_dynamic_bsz is that buckets need it, and buckets are what
        # dynamic_bsz_bucketing asked for.
        "use_dynamic_bsz": "actor_rollout_ref.actor.dynamic_bsz_bucketing",
    }
    spec = build(spec_keys, MicroBatchSpec, use_dynamic_bsz=dynamic,
                 micro_batch_size_per_gpu=None if dynamic else micro,
                 max_token_len_per_gpu=max_tokens if dynamic else None, bucket_boundaries=tuple(buckets) if buckets else None)
    if dynamic and spec.token_budget(sp) < max_seq:
        raise ConfigError(
            f"{prefix}.{tokens_key}={max_tokens} x ulysses_sequence_parallel_size={sp} = {spec.token_budget(sp)} "
            f"tokens is smaller than one full sample: data.max_prompt_length + data.max_response_length = {max_seq}"
        )
    return spec


def _train_role(prefix: str, world: int, samples: int, n: int, sp: int, mini: int, train_batch_size: int, *,
                train: MicroBatchSpec, infer: MicroBatchSpec, pipeline: Optional[PipelineCostModel] = None) -> RoleSizes:
    pp = 1 if pipeline is None else pipeline.shape.pp_size
    dp = world // (sp * pp)
    dp_name = f"{prefix} dp size (world // {prefix}.ulysses_sequence_parallel_size)" if pp == 1 else (
        f"{prefix} dp size (world // ({prefix}.ulysses_sequence_parallel_size x "
        f"{prefix}.megatron.pipeline_model_parallel_size))")
    _divides(dp, samples, dp_name, _SAMPLES)
    if mini < 1 or mini > train_batch_size:
        raise ConfigError(f"{prefix}.ppo_mini_batch_size={mini} must be in [1, data.train_batch_size={train_batch_size}]")
    if train_batch_size % mini != 0:
        raise ConfigError(
            f"data.train_batch_size={train_batch_size} is not divisible by {prefix}.ppo_mini_batch_size={mini}"
        )
    mini_samples = mini * n
    _divides(dp, mini_samples, dp_name, f"{prefix}.ppo_mini_batch_size * rollout.n")
    per_rank = mini_samples // dp
    accum = None
    if not train.use_dynamic_bsz:
        if per_rank % train.micro_batch_size_per_gpu != 0:
            raise ConfigError(
                f"{prefix}: mini-batch samples per rank = ppo_mini_batch_size * rollout.n / dp = "
                f"{mini} * {n} / {dp} = {per_rank} is not divisible by "
                f"{prefix}.ppo_micro_batch_size_per_gpu={train.micro_batch_size_per_gpu}"
            )
        accum = per_rank // train.micro_batch_size_per_gpu
    return RoleSizes(
        dp_size=dp, sp_size=sp, samples_per_rank=samples // dp, infer=infer, mini_batch_samples=mini_samples,
        mini_batch_samples_per_rank=per_rank, num_mini_batches=samples // mini_samples, grad_accum_steps=accum,
        train=train, pp_size=pp, pipeline=pipeline,
    )
