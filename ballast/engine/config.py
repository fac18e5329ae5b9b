"""Frozen configuration objects of the training engine.

The trainer builds these from its config at start-up; the engine never mutates them. Every field
that has a unit carries it in its name (`*_per_gpu`, `*_tokens`, `*_steps`). Each rule about a field
is checked here and nowhere else: an invalid value raises `SpecError`, which names the field so that
the trainer can report the config key it came from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, get_args

from ballast.balance import MicroBatchMode, MicroBatchPolicy, PipelineShape
from ballast.balance.bucketing import check_bucket_boundaries
from ballast.balance.pipeline import SCHEDULE_KINDS

# The allowed values of each choice field, stated once; the tuples are read back from the types.
Role = Literal["actor", "critic", "ref", "reward"]
LrSchedule = Literal["constant", "cosine"]
Device = Literal["auto", "cpu", "cuda"]
AttnBackend = Literal["auto", "sdpa", "flash"]
Precision = Literal["auto", "fp32", "bf16"]
ROLES: tuple[str, ...] = get_args(Role)
LR_SCHEDULES: tuple[str, ...] = get_args(LrSchedule)
DEVICES: tuple[str, ...] = get_args(Device)
ATTN_BACKENDS: tuple[str, ...] = get_args(AttnBackend)
PRECISIONS: tuple[str, ...] = get_args(Precision)


class SpecError(ValueError):
    """An invalid field of a frozen spec. `field` is the field's name, so that a caller that built the
    spec from its own settings can say which of them was wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and learning-rate schedule.

    The schedule is a factor on `lr` as a function of the number of optimizer steps already taken
    (see `ballast.engine.optim.lr_factor`): linear warmup over `warmup_steps`, then constant or a
    cosine decay to `min_lr_ratio * lr` at `total_steps`.
    """

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    lr_schedule: LrSchedule = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise SpecError("lr", f"optim.lr must be >= 0, got {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise SpecError("lr_schedule", f"optim.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.warmup_steps < 0:
            raise SpecError("warmup_steps", f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise SpecError("min_lr_ratio", f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.lr_schedule == "cosine":
            if self.total_steps is None or self.total_steps <= self.warmup_steps:
                raise SpecError("lr_schedule",
                    f"optim.lr_schedule='cosine' needs optim.total_steps > optim.warmup_steps, "
                    f"got total_steps={self.total_steps}, warmup_steps={self.warmup_steps}"
                )


def _module_names(name: str, value) -> str | tuple[str, ...] | None:
    """`value` as PEFT takes module selectors: one string (a regex, or `all-linear`) or a tuple of names."""
    if value is None or isinstance(value, str):
        if isinstance(value, str) and not value.strip():
            raise SpecError(name, f"lora {name} must be a non-empty string or a list of module names, got {value!r}")
        return value
    try:
        names = tuple(value)
    except TypeError:
        raise SpecError(name, f"lora {name} must be a string or a list of module names, got {value!r}") from None
    if not names or not all(isinstance(n, str) and n for n in names):
        raise SpecError(name, f"lora {name} must be a non-empty list of module names, got {list(names)!r}")
    return names


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter on the engine's model (PEFT), in verl's terms.

    `rank` > 0 adds a fresh adapter (A random, B zero: the model starts as the base model) on the modules
    `target_modules` selects (`all-linear`: every linear layer but the output head; a list of module
    names; or one regular expression), minus `exclude_modules`; its update is scaled by `alpha / rank`.
    `adapter_path`: a PEFT adapter directory to continue training from; its own `adapter_config.json`
    then decides rank, alpha and targets (`rank` may stay 0). Only the adapter (and a critic's value
    head) is trained; the base weights stay frozen.
    """

    rank: int = 0
    alpha: float = 16.0
    target_modules: str | tuple[str, ...] = "all-linear"
    exclude_modules: str | tuple[str, ...] | None = None
    adapter_path: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise SpecError("rank", f"lora rank must be an int >= 0 (0: no adapter), got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise SpecError("alpha", f"lora alpha must be a number > 0, got {self.alpha!r}")
        object.__setattr__(self, "target_modules", _module_names("target_modules", self.target_modules))
        if self.target_modules is None:
            raise SpecError("target_modules", "lora target_modules must be set (e.g. 'all-linear')")
        object.__setattr__(self, "exclude_modules", _module_names("exclude_modules", self.exclude_modules))
        if self.adapter_path is not None:
            path = str(self.adapter_path)
            if not os.path.isfile(os.path.join(path, "adapter_config.json")):
                raise SpecError("adapter_path", f"lora adapter_path={path!r} is not a PEFT adapter directory "
                                                "(no adapter_config.json in it)")
            from ballast.engine.safe_load import RefusedFileError, check_adapter_weights

            try:
                check_adapter_weights(path)
            except RefusedFileError as err:
                raise SpecError("adapter_path", f"lora adapter_path={path!r}: {err}") from None
            object.__setattr__(self, "adapter_path", path)

    @property
    def enabled(self) -> bool:
        """Whether the engine trains an adapter (verl: `lora_rank > 0` or `lora_adapter_path` set)."""
        return self.rank > 0 or self.adapter_path is not None


@dataclass(frozen=True)
class PipelineSpec:
    """Pipeline parallelism of an engine (`ballast.engine.pipeline`), in verl's Megatron terms.

    `pp_size`: pipeline ranks (verl's `pipeline_model_parallel_size`; 1: no pipeline); the data-parallel
    size is then world / pp_size. `virtual_stages`: stages per rank (`virtual_pipeline_model_parallel_size`).
    `schedule`: `1f1b`, `interleaved_1f1b` or `zero_bubble` (torch.distributed.pipelining's Schedule1F1B,
    ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble). `microbatch_group_size`: verl's
    `microbatch_group_size_per_vp_stage` (null: pp_size, the only value torch's interleaved schedules run).
    """

    pp_size: int = 1
    virtual_stages: int = 1
    schedule: str = "1f1b"
    microbatch_group_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.pp_size, bool) or not isinstance(self.pp_size, int) or self.pp_size < 1:
            raise SpecError("pp_size", f"pipeline_model_parallel_size must be an int >= 1, got {self.pp_size!r}")
        if self.schedule not in SCHEDULE_KINDS:
            raise SpecError("schedule", f"pipeline schedule must be one of {SCHEDULE_KINDS}, got {self.schedule!r}")
        if self.pp_size == 1:
            if self.virtual_stages != 1:
                raise SpecError("virtual_stages", f"virtual_pipeline_model_parallel_size={self.virtual_stages} needs "
                                "pipeline_model_parallel_size > 1")
            return
        try:
            self.shape
        except ValueError as err:
            field_name = "microbatch_group_size" if "group_size" in str(err) else (
                "virtual_stages" if "virtual" in str(err) else "schedule")
            raise SpecError(field_name, str(err)) from None

    @property
    def enabled(self) -> bool:
        return self.pp_size > 1

    @property
    def shape(self) -> PipelineShape:
        return PipelineShape(self.pp_size, self.virtual_stages, self.schedule, self.microbatch_group_size)


def _check_pipeline_composes(cfg: "EngineConfig") -> None:
    """What a pipeline engine does not do, named at construction (each a SpecError on its field)."""
    pp = cfg.pipeline.pp_size
    rules = (
        ("use_remove_padding", not cfg.use_remove_padding,
         "needs use_remove_padding=True (micro-batches travel as packed token slots)"),
        ("ulysses_sequence_parallel_size", cfg.ulysses_sequence_parallel_size > 1,
         f"does not compose with Ulysses sequence parallelism (ulysses_sequence_parallel_size="
         f"{cfg.ulysses_sequence_parallel_size}): set one of them to 1"),
        ("lora", cfg.lora.enabled, "does not train LoRA adapters: set lora_rank=0 or pipeline_model_parallel_size=1"),
        ("cpu_offload", cfg.cpu_offload, "does not offload parameters: set param_offload/offload_policy false"),
        ("fsdp_size", cfg.fsdp_size not in (-1, 1),
         f"keeps whole replicas of each stage (fsdp_size={cfg.fsdp_size} would shard them): set fsdp_size -1 or 1"),
        ("precision", cfg.precision == "bf16", "computes in fp32 only: set the mixed precision param_dtype to fp32"),
    )
    for name, broken, why in rules:
        if broken:
            raise SpecError(name, f"pipeline parallelism (pipeline_model_parallel_size={pp}) {why}")


@dataclass(frozen=True)
class EngineConfig:
    """What one engine (actor, critic or reference model) loads and how it is parallelised.

    `precision="auto"` means bf16 compute with fp32 master weights and fp32 gradient reduction on CUDA,
    plain fp32 on CPU. `cpu_offload` (FSDP2 parameter/gradient/optimizer offload) exists on CUDA only.
    `logprob_chunk_tokens` bounds how many token rows of full-vocab float32 logits exist at once when
    log-probs and entropy are computed. `fsdp_size`: how many ranks share one copy of the parameters
    (-1 or >= the world size: one copy sharded over every rank; k: hybrid sharding, world / k replicas
    of a k-way shard, each replica gradient-summed with the others; 1: every rank holds the whole model).
    `lora`: train a LoRA adapter instead of the full weights (`LoraSpec.enabled`); the reference role
    never carries one (it is the actor with the adapter switched off). `pipeline`: pipeline parallelism
    (`PipelineSpec`; `ballast.engine.build_engine` then builds a `PipelineEngine`); what it does not
    compose with is a `SpecError` here.
    """

    model_path: str
    role: Role = "actor"
    use_remove_padding: bool = True
    ulysses_sequence_parallel_size: int = 1
    device: Device = "auto"
    precision: Precision = "auto"
    attn_backend: AttnBackend = "auto"
    enable_activation_checkpointing: bool = False
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    fsdp_size: int = -1
    grad_clip: float | None = 1.0
    optim: OptimConfig = field(default_factory=OptimConfig)
    logprob_chunk_tokens: int = 1024
    trust_remote_code: bool = False
    lora: LoraSpec = field(default_factory=LoraSpec)
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)

    def __post_init__(self) -> None:
        for name, allowed in (("role", ROLES), ("device", DEVICES), ("precision", PRECISIONS),
                              ("attn_backend", ATTN_BACKENDS)):
            value = getattr(self, name)
            if value not in allowed:
                raise SpecError(name, f"engine {name} must be one of {allowed}, got {value!r}")
        sp = self.ulysses_sequence_parallel_size
        if not isinstance(sp, int) or sp < 1:
            raise SpecError("ulysses_sequence_parallel_size",
                            f"ulysses_sequence_parallel_size must be an int >= 1, got {sp!r}")
        if sp > 1 and not self.use_remove_padding:
            raise SpecError(
                "ulysses_sequence_parallel_size",
                f"ulysses_sequence_parallel_size={sp} needs use_remove_padding=True "
                "(Ulysses slices the packed token sequence)",
            )
        if not isinstance(self.fsdp_size, int) or isinstance(self.fsdp_size, bool) or (
                self.fsdp_size != -1 and self.fsdp_size < 1):
            raise SpecError("fsdp_size", f"fsdp_size must be -1 or an int >= 1, got {self.fsdp_size!r}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise SpecError("grad_clip", f"grad_clip must be > 0 or None, got {self.grad_clip}")
        if self.logprob_chunk_tokens < 1:
            raise SpecError("logprob_chunk_tokens",
                            f"logprob_chunk_tokens must be >= 1, got {self.logprob_chunk_tokens}")
        if not isinstance(self.lora, LoraSpec):
            raise SpecError("lora", f"lora must be a LoraSpec, got {self.lora!r}")
        if self.lora.enabled and not self.trainable:
            raise SpecError("lora", f"role {self.role!r} trains nothing and cannot carry a LoRA adapter "
                                    "(the reference model with LoRA is the actor with its adapter disabled)")
        if not isinstance(self.pipeline, PipelineSpec):
            raise SpecError("pipeline", f"pipeline must be a PipelineSpec, got {self.pipeline!r}")
        if self.pipeline.enabled:
            _check_pipeline_composes(self)

    @property
    def trainable(self) -> bool:
        return self.role in ("actor", "critic")


@dataclass(frozen=True)
class MicroBatchSpec:
    """How one mini-batch is cut into micro-batches on each rank.

    Static: `micro_batch_size_per_gpu` samples per micro-batch. Dynamic: each micro-batch holds at
    most `max_token_len_per_gpu * sp_size` real tokens (the SP group shares the packed sequence), and
    the number of micro-batches is agreed across the data-parallel group.
    """

    use_dynamic_bsz: bool = False
    micro_batch_size_per_gpu: int | None = None
    max_token_len_per_gpu: int | None = None
    # Dynamic only: micro-batches never mix samples from different prompt-length buckets
    # (prompts <= b[0] tokens, <= b[1], ..., longer than b[-1]).
    bucket_boundaries: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.bucket_boundaries is not None:
            bounds = tuple(int(b) for b in self.bucket_boundaries)
            if not self.use_dynamic_bsz:
                raise SpecError("use_dynamic_bsz", f"bucket_boundaries={list(bounds)} needs use_dynamic_bsz=True "
                                "(buckets split dynamic micro-batches), got use_dynamic_bsz=False")
            try:
                check_bucket_boundaries(bounds)
            except ValueError as err:
                raise SpecError("bucket_boundaries", str(err)) from None
            object.__setattr__(self, "bucket_boundaries", bounds)
        if self.use_dynamic_bsz:
            if self.max_token_len_per_gpu is None or self.max_token_len_per_gpu < 1:
                raise SpecError(
                    "max_token_len_per_gpu",
                    "MicroBatchSpec(use_dynamic_bsz=True) needs max_token_len_per_gpu >= 1, "
                    f"got {self.max_token_len_per_gpu!r}",
                )
        elif self.micro_batch_size_per_gpu is None or self.micro_batch_size_per_gpu < 1:
            raise SpecError(
                "micro_batch_size_per_gpu",
                "MicroBatchSpec(use_dynamic_bsz=False) needs micro_batch_size_per_gpu >= 1, "
                f"got {self.micro_batch_size_per_gpu!r} (or set use_dynamic_bsz=True)",
            )

    def token_budget(self, sp_size: int) -> int:
        """Real tokens one dynamic micro-batch may hold on an SP group of `sp_size` ranks."""
        if not self.use_dynamic_bsz:
            raise ValueError("token_budget() is defined for dynamic micro-batching only")
        return int(self.max_token_len_per_gpu) * int(sp_size)

    def policy(self, sp_size: int) -> MicroBatchPolicy:
        """The planner's view of this spec on an SP group of `sp_size` ranks."""
        if not self.use_dynamic_bsz:
            return MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=self.micro_batch_size_per_gpu)
        mode = MicroBatchMode.DYNAMIC if self.bucket_boundaries is None else MicroBatchMode.BUCKETED
        return MicroBatchPolicy(mode, token_budget=self.token_budget(sp_size), bucket_boundaries=self.bucket_boundaries)
