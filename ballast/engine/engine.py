"""`TrainEngine`: one model (actor, critic or reference) on the (dp, sp) mesh, TensorDict in and out.

One call of `forward_backward_batch` processes one mini-batch (this rank's share):

1. preflight, collective over the DP group: check the layout and the caller's plan (the mini-batch's
   micro-batches on every DP rank, from `ballast.balance.plan_phase`: the engine never plans), agree
   any error (MAX), and sum the loss tokens and sequences into a `GlobalNorm` (SUM); a loss that
   declares a `MiniBatchStatistic` gets its sums too (one more SUM; with `needs_outputs`, after a
   forward-only pass over the micro-batches under the same weights);
2. for every micro-batch: forward (padded, packed, or packed + Ulysses), `loss_fn(outputs, micro,
   norm)`, backward. The loss returned by `loss_fn` is the micro-batch's exact share of the mini-batch
   loss, so summing over micro-batches and DP ranks gives the mini-batch loss;
3. data parallelism (FSDP2 reduce-scatter or DDP all-reduce, see `parallelize`) sums gradients
   with a plain SUM, so the accumulated gradient is the gradient of the mini-batch loss whatever the
   dp size, sp size or micro-batch cut;
4. metrics: summed over micro-batches and over the DP group (they are shares too).

An empty micro-batch in the plan (a rank holding fewer rows than the agreed count) back-propagates a
zero-weighted output, contributing exactly zero gradient while issuing the same collectives.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from tensordict import TensorDict

from ballast.balance import FlopsModel, MiniBatchPlan
from ballast.engine import checkpoint as ckpt
from ballast.engine.config import EngineConfig, MicroBatchSpec
from ballast.engine.data_parallel import DataParallelMode
from ballast.engine.dist import (ParallelState, build_parallel_state, init_distributed, resolve_device_type,
                                 resolve_shard_size)
from ballast.engine.gather import iter_gathered, layer_of
from ballast.engine.lora import Adapter, attach_adapter, base_state, is_adapter_param, merged_state, peft_name
from ballast.engine.forward import ForwardOptions, forward_micro_batch
from ballast.engine.losses import GlobalNorm, MiniBatchStatistic, add_statistic, mini_batch_statistic
from ballast.engine.micro_batch import (
    agree_max,
    check_rank_plan,
    dummy_micro_batch,
    micro_batch_tokens,
    plan_rank_micro_batches,
    restore_order,
)
from ballast.engine.model import load_model
from ballast.engine.optim import build_optimizer, build_scheduler, clip_and_step
from ballast.engine.padding import check_padded_layout, sequence_lengths
from ballast.engine.parallelize import parallelize

REQUIRED_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
RESERVED_METRICS = ("loss", "num_micro_batches", "num_dummy_micro_batches", "num_tokens", "num_sequences")
LossFn = Callable[[dict, TensorDict, GlobalNorm], tuple[torch.Tensor, dict]]


def row_index(rows) -> torch.Tensor:
    """A micro-batch's row indices as an int64 tensor. A copy: a plan that came through Ray holds
    read-only numpy arrays, which torch would share (and warn about) rather than copy."""
    return torch.tensor(rows, dtype=torch.int64)


def _check_batch(data: TensorDict) -> str | None:
    """Error message for a malformed mini-batch, or None."""
    missing = [k for k in REQUIRED_KEYS if k not in data.keys()]
    if missing:
        return f"mini-batch is missing keys {missing} (has {sorted(data.keys())})"
    batch, seq_len = data["input_ids"].shape
    response_len = data["responses"].shape[-1]
    for key in ("attention_mask", "position_ids"):
        if tuple(data[key].shape) != (batch, seq_len):
            return f"{key} has shape {tuple(data[key].shape)}, expected {(batch, seq_len)} like input_ids"
    if tuple(data["response_mask"].shape) != (batch, response_len):
        return f"response_mask has shape {tuple(data['response_mask'].shape)}, expected {(batch, response_len)}"
    try:
        check_padded_layout(data["attention_mask"], response_len)
    except ValueError as exc:
        return str(exc)
    if not torch.equal(data["input_ids"][:, seq_len - response_len :], data["responses"]):
        return "responses differ from the last R columns of input_ids"
    return None


def _flops_model(config):
    try:
        return FlopsModel.from_hf_config(config.to_dict())
    except ValueError:  # a config without the usual fields: fall back to balancing tokens
        return "tokens"


class TrainEngine:
    """Load, parallelise and run one model. Collective: every rank of the mesh makes the same calls."""

    def __init__(self, cfg: EngineConfig, parallel: ParallelState | None = None, seed: int = 0) -> None:
        self.cfg = cfg
        if parallel is None:
            device_type = resolve_device_type(cfg.device)
            init_distributed(device_type)
            parallel = build_parallel_state(cfg.ulysses_sequence_parallel_size, device_type, cfg.fsdp_size)
        if parallel.sp_size != cfg.ulysses_sequence_parallel_size:
            raise ValueError(
                f"parallel state has sp={parallel.sp_size} but ulysses_sequence_parallel_size="
                f"{cfg.ulysses_sequence_parallel_size}"
            )
        if parallel.shard_size != resolve_shard_size(cfg.fsdp_size, parallel.world_size):
            raise ValueError(f"parallel state shards parameters over {parallel.shard_size} rank(s) but "
                             f"fsdp_size={cfg.fsdp_size}")
        self.parallel = parallel
        # `model`: the HF module (parameters, state dicts, inference); `data_parallel.module`: what
        # training forwards go through, the same object under FSDP2 or a DDP wrapper around it.
        self.model = load_model(cfg.model_path, cfg.role, cfg.trust_remote_code, seed)
        # A LoRA adapter goes in before parallelisation, so FSDP2 / DDP treat it like any parameter;
        # everything else is frozen, and the optimizer below sees the adapter only.
        self.adapter: Adapter | None = (attach_adapter(self.model, cfg.lora, cfg.role, seed)
                                        if cfg.lora.enabled else None)
        self.data_parallel = parallelize(self.model, parallel, cfg)
        # Dynamic micro-batches are balanced by this model's forward FLOPs (linear + causal attention),
        # so long samples count for what they cost, not just for their tokens.
        self.workload = _flops_model(self.model.config)
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim) if cfg.trainable else None
        self.scheduler = build_scheduler(self.optimizer, cfg.optim) if cfg.trainable else None
        self.global_step = 0
        self.skipped_steps = 0
        # Real tokens of each micro-batch of the last forward_backward_batch, one list per DP rank.
        self.last_micro_batch_tokens: list[list[int]] = []

    @property
    def data_parallel_mode(self) -> DataParallelMode:
        """How the model is spread over ranks: "fsdp" (FSDP2), "ddp" (a whole trainable replica per
        rank, gradients summed by DDP) or "replica" (a whole frozen replica per rank)."""
        return self.data_parallel.mode

    # ------------------------------------------------------------------ mini-batch execution
    def _preflight(self, data: TensorDict, plan: MiniBatchPlan) -> tuple[GlobalNorm, tuple, list[int]]:
        """The DP-global loss normaliser, this rank's micro-batches from `plan` and each one's real
        tokens. Collective over the DP group: a malformed batch or plan on any rank raises on all."""
        error = _check_batch(data)
        group, device = self.parallel.dp_group, self.parallel.device
        lengths = None if error else sequence_lengths(data["attention_mask"]).cpu().numpy()
        tokens_of = None
        if error is None:
            tokens_of = micro_batch_tokens(plan, data, lengths) if isinstance(plan, MiniBatchPlan) else None
            error = check_rank_plan(plan, self.parallel.dp_size, self.parallel.dp_rank, lengths, tokens_of)
        if error is None and plan.shared_prompts and (not self.cfg.use_remove_padding or self.parallel.sp_size > 1):
            error = "a shared-prompt plan needs use_remove_padding=True and no Ulysses sequence parallelism"
        local_response_len = 0 if error else int(data["responses"].shape[-1])
        # One MAX all-reduce: a malformed batch or plan on any DP rank makes every rank raise here.
        any_error, response_len = agree_max([int(error is not None), local_response_len], group, device)
        if any_error:
            raise ValueError(error or "another DP rank received a malformed mini-batch or micro-batch plan")
        self._check_sp_peers_agree(data)
        counts = torch.tensor(
            [float(data["response_mask"].sum()), float(data.batch_size[0])], dtype=torch.float64, device=device
        )
        if self.parallel.dp_size > 1:
            dist.all_reduce(counts, group=group)
        norm = GlobalNorm(num_tokens=int(counts[0]), num_sequences=int(counts[1]), response_len=response_len)
        micro = plan.for_rank(self.parallel.dp_rank)
        return norm, micro, [tokens_of(idx) for idx in micro if len(idx)]  # zero-weight steps hold none

    def plan_micro_batches(self, data: TensorDict, spec: MicroBatchSpec) -> MiniBatchPlan:
        """A plan for `data` as this rank holds it (every rank its own rows), for use without the
        trainer's driver: `ballast.balance.plan_phase` over all ranks' lengths. Collective over DP."""
        prompt_lengths = None
        if spec.bucket_boundaries is not None:
            prompt_width = data["input_ids"].shape[1] - data["responses"].shape[1]
            prompt_lengths = data["attention_mask"][:, :prompt_width].sum(-1).cpu().numpy()
        return plan_rank_micro_batches(sequence_lengths(data["attention_mask"]).cpu().numpy(),
                                       spec.policy(self.parallel.sp_size), self.parallel.dp_group,
                                       prompt_lengths, self.workload)

    def _check_sp_peers_agree(self, data: TensorDict) -> None:
        """SP peers must hold identical micro-batches; a cheap fingerprint catches a dispatch bug."""
        if self.parallel.sp_size == 1:
            return
        ids = data["input_ids"].to(torch.int64) * data["attention_mask"].to(torch.int64)
        weights = torch.arange(1, ids.shape[-1] + 1, device=ids.device)
        fingerprint = [int(data.batch_size[0]), int((ids * weights).sum()) % (2**61 - 1)]
        both = agree_max(fingerprint + [-v for v in fingerprint], self.parallel.sp_group, self.parallel.device)
        high, low = both[:2], [-v for v in both[2:]]
        if high != low:
            raise ValueError(f"SP peers hold different mini-batches (fingerprints range {low}..{high})")

    def _forward_options(self, plan: MiniBatchPlan, temperature: float, calculate_entropy: bool) -> ForwardOptions:
        return ForwardOptions(
            share_prompts=plan.shared_prompts,
            is_critic=self.cfg.role in ("critic", "reward"),  # a score per position
            use_remove_padding=self.cfg.use_remove_padding,
            temperature=temperature,
            calculate_entropy=calculate_entropy,
            chunk_tokens=self.cfg.logprob_chunk_tokens,
            attn_backend=self.cfg.attn_backend,
        )

    def _run_dummy(self, module: torch.nn.Module, seq_len: int, response_len: int, opts: ForwardOptions,
                   backward: bool) -> None:
        dummy = dummy_micro_batch(seq_len, response_len, self.parallel.device)
        outputs = forward_micro_batch(module, dummy, opts, self.parallel)
        if backward:
            zero = sum(v.sum() for v in outputs.values()) * 0.0
            zero.backward()

    def forward_backward_batch(
        self,
        data: TensorDict,
        loss_fn: LossFn,
        plan: MiniBatchPlan,
        forward_only: bool = False,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
    ) -> dict[str, float]:
        """Forward (and backward) this rank's mini-batch; gradients accumulate into `.grad`.

        `plan`: the mini-batch's micro-batches for every DP rank (`ballast.balance.plan_phase`; the
        same object on every rank; `plan_micro_batches` makes one for rows already placed).

        `loss_fn(outputs, micro, norm) -> (loss, metrics)`: outputs are `log_probs` (+`entropy`) or
        `values`, (B_micro, R); loss and every metric must be the micro-batch's SHARE of the mini-batch
        value (normalise with `norm`, e.g. via `agg_loss`). Returns the mini-batch `loss` and metrics
        (summed over micro-batches and the DP group) plus bookkeeping counts. Collective.
        """
        if not forward_only and not self.cfg.trainable:
            raise ValueError(f"role {self.cfg.role!r} has no optimizer; call with forward_only=True")
        norm, micro_batches, micro_tokens = self._preflight(data, plan)
        opts = self._forward_options(plan, temperature, calculate_entropy)
        module = self.model if forward_only else self.data_parallel.module
        module.train(not forward_only)
        statistic = mini_batch_statistic(loss_fn)
        if statistic is not None:
            norm = norm.with_stats(self._statistic_sums(statistic, data, micro_batches, opts))
        # Accumulated on the device and read once at the end: no host sync per micro-batch.
        sums: dict[str, torch.Tensor] = {"loss": torch.zeros((), dtype=torch.float64, device=self.parallel.device)}
        backwards = 0 if forward_only else len(micro_batches)
        with torch.set_grad_enabled(not forward_only):
            for index, rows in enumerate(micro_batches):
                with self._gradient_sync(index == backwards - 1, backwards):
                    if len(rows):
                        self._micro_step(data, rows, loss_fn, norm, opts, module, forward_only, sums)
                    else:
                        self._run_dummy(module, data["input_ids"].shape[1], data["responses"].shape[1], opts,
                                        backward=not forward_only)
        result, self.last_micro_batch_tokens = self._sum_over_dp(
            {key: float(value) for key, value in sums.items()}, micro_tokens)
        result.update(
            num_micro_batches=float(len(micro_batches)),
            num_dummy_micro_batches=float(sum(1 for rows in micro_batches if not len(rows))),
            num_tokens=float(norm.num_tokens),
            num_sequences=float(norm.num_sequences),
        )
        return result

    def _statistic_sums(self, statistic: MiniBatchStatistic, data: TensorDict, micro_batches: tuple,
                        opts: ForwardOptions) -> dict[str, float]:
        """The statistic's sums over the whole mini-batch: this rank's micro-batches (a forward-only
        pass of the unwrapped model when it reads outputs: the weights the training forward will
        use), then one SUM over the DP group. Collective."""
        device = self.parallel.device
        total = torch.zeros(len(statistic.keys), dtype=torch.float64, device=device)

        with torch.no_grad():
            if not statistic.needs_outputs:
                if data.batch_size[0]:
                    add_statistic(total, statistic, None, data.to(device))
            else:
                for rows in micro_batches:
                    if not len(rows):  # FSDP2's per-micro-batch collectives stay in lockstep
                        self._run_dummy(self.model, data["input_ids"].shape[1], data["responses"].shape[1], opts,
                                        backward=False)
                        continue
                    micro = data[row_index(rows)].to(device)
                    add_statistic(total, statistic, forward_micro_batch(self.model, micro, opts, self.parallel), micro)
        if self.parallel.dp_size > 1:
            dist.all_reduce(total, group=self.parallel.dp_group)
        return dict(zip(statistic.keys, total.tolist()))

    def _micro_step(self, data, rows, loss_fn, norm, opts, module, forward_only, sums) -> None:
        """Forward one micro-batch, its loss share and (unless forward-only) backward; sums the metrics."""
        device = self.parallel.device
        micro = data[row_index(rows)].to(device)
        outputs = forward_micro_batch(module, micro, opts, self.parallel)
        loss, metrics = loss_fn(outputs, micro, norm)
        clash = sorted(set(metrics) & set(RESERVED_METRICS))
        if clash:
            raise ValueError(f"loss_fn returned metrics {clash}, names the engine reserves for itself")
        if not forward_only:
            loss.backward()
        for key, value in {"loss": loss, **metrics}.items():
            value = torch.as_tensor(value.detach() if torch.is_tensor(value) else value, device=device)
            sums[key] = sums.get(key, 0.0) + value.to(torch.float64)

    def _gradient_sync(self, last_backward: bool, backwards: int) -> contextlib.AbstractContextManager:
        """The scope of one micro-batch's forward and backward (`DataParallel.gradient_sync`): DDP,
        and FSDP2 on CPU, reduce gradients once per mini-batch, in the last backward. Forward-only
        calls (`backwards == 0`) reduce nothing."""
        if not backwards:
            return contextlib.nullcontext()
        return self.data_parallel.gradient_sync(last_backward)

    def _sum_over_dp(self, sums: dict[str, float], micro_tokens: list[int]) -> tuple[dict[str, float], list]:
        """Metric sums over the DP group, and every DP rank's real-token count per micro-batch."""
        if self.parallel.dp_size == 1:
            return dict(sums), [list(micro_tokens)]
        gathered: list[tuple] = [None] * self.parallel.dp_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, (sums, list(micro_tokens)), group=self.parallel.dp_group)
        total: dict[str, float] = {}
        for part, _ in gathered:
            for key, value in part.items():
                total[key] = total.get(key, 0.0) + value
        return total, [tokens for _, tokens in gathered]

    @torch.no_grad()
    def infer_batch(self, data: TensorDict, plan: MiniBatchPlan, temperature: float = 1.0,
                    calculate_entropy: bool = False) -> TensorDict:
        """`log_probs` (+`entropy`) for actor/ref, `values` for a critic: (B, R), input row order.
        `plan`: as in `forward_backward_batch`. Collective."""
        _, micro_batches, _ = self._preflight(data, plan)
        opts = self._forward_options(plan, temperature, calculate_entropy)
        self.model.eval()
        per_key: dict[str, list[torch.Tensor]] = {}
        for rows in micro_batches:
            if not len(rows):
                self._run_dummy(self.model, data["input_ids"].shape[1], data["responses"].shape[1], opts,
                                backward=False)
                continue
            micro = data[row_index(rows)].to(self.parallel.device)
            for key, value in forward_micro_batch(self.model, micro, opts, self.parallel).items():
                per_key.setdefault(key, []).append(value.detach())
        batch = data.batch_size[0]
        if batch == 0:
            keys = ["values"] if opts.is_critic else ["log_probs"] + (["entropy"] if calculate_entropy else [])
            empty = torch.zeros(0, data["responses"].shape[1], device=self.parallel.device)
            return TensorDict({k: empty.clone() for k in keys}, batch_size=[0])
        real = tuple(rows for rows in micro_batches if len(rows))
        restored = {key: restore_order(values, real) for key, values in per_key.items()}
        return TensorDict(restored, batch_size=[batch])

    # ------------------------------------------------------------------ optimizer
    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, grad_clip: float | None = None, step_scheduler: bool = True) -> dict[str, float]:
        """Clip, step (unless the grad norm is not finite), advance the schedule, zero the grads.

        `grad_clip` overrides `cfg.grad_clip` for this step (adaptive clipping); it must be > 0.
        `step_scheduler=False` leaves the schedule alone: the update loop counts the schedule in
        training steps (one `lr_scheduler_step` per update call, as verl), not in mini-batches.
        """
        if self.optimizer is None:
            raise ValueError(f"role {self.cfg.role!r} has no optimizer")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip override must be > 0, got {grad_clip}")
        lr = self.optimizer.param_groups[0]["lr"]
        params = [p for p in self.model.parameters() if p.requires_grad]
        clip = grad_clip if grad_clip is not None else self.cfg.grad_clip
        grad_norm, stepped = clip_and_step(params, self.optimizer, self.scheduler if step_scheduler else None, clip,
                                           self.parallel.replica_group)
        if stepped:
            self.global_step += 1
        else:
            self.skipped_steps += 1
        return {
            "grad_norm": grad_norm if math.isfinite(grad_norm) else float("nan"),
            "lr": float(lr),
            "step_skipped": float(not stepped),
            "skipped_steps": float(self.skipped_steps),
            "global_step": float(self.global_step),
        }

    def lr_scheduler_step(self) -> float:
        """Advance the schedule by one training step; returns the learning rate of the next step."""
        if self.scheduler is None:
            raise ValueError(f"role {self.cfg.role!r} has no optimizer")
        self.scheduler.step()
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ weights and checkpoints
    def iter_full_state_dict(self, layered: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, full tensor) for every weight, same order on every rank. Collective.

        A tied weight comes under each of its names: vLLM's in-place reload on CPU re-packs a tied
        lm_head only when `lm_head.weight` arrives (without it, generation kept the old head). With a
        LoRA adapter these are the merged weights (W + scaling * B A), under the base model's names.
        `layered`: gather at most one decoder layer's tensors at a time (verl's `layered_summon`).
        """
        # Not state_dict(keep_vars=True): after a forward it can hold FSDP2's unsharded pre-step
        # tensors, while state_dict() goes through FSDP2's hooks to the sharded ones.
        named = self._gathered(lambda name: True, layered)
        yield from named if self.adapter is None else merged_state(named, self.adapter.scalings)

    def iter_adapter_state_dict(self, layered: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(PEFT file name, full tensor) of the LoRA adapter only, same order on every rank. Collective."""
        self._require_adapter()
        for name, tensor in self._gathered(is_adapter_param, layered):
            yield peft_name(name), tensor

    def iter_base_state_dict(self, layered: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of the frozen base model under a LoRA adapter. Collective."""
        self._require_adapter()
        yield from base_state(self._gathered(lambda name: not is_adapter_param(name), layered))

    def _gathered(self, keep, layered: bool) -> Iterator[tuple[str, torch.Tensor]]:
        named = ((n, t) for n, t in self.model.state_dict().items() if keep(n))
        yield from iter_gathered(named, boundary=layer_of if layered else None)

    def _require_adapter(self) -> Adapter:
        if self.adapter is None:
            raise ValueError(f"the {self.cfg.role} engine has no LoRA adapter")
        return self.adapter

    def adapter_disabled(self) -> contextlib.AbstractContextManager:
        """Forwards inside run the base model: the reference policy of a LoRA run. Local switch."""
        return self._require_adapter().disabled()

    def probe_log_probs(self, tokens: list[int], plan: MiniBatchPlan | None = None) -> torch.Tensor:
        """log p(token_t | tokens_<t), t >= 1, of one sequence under the current weights (temperature 1):
        what a rollout engine's prompt log-probs must match after a weight sync. Collective; every
        rank passes the same tokens."""
        if len(tokens) < 2:
            raise ValueError(f"a probe needs at least 2 tokens, got {len(tokens)}")
        ids = torch.as_tensor([list(tokens)], dtype=torch.int64)
        ones = torch.ones_like(ids)
        probe = TensorDict({"input_ids": ids, "attention_mask": ones, "position_ids": torch.arange(ids.shape[1])[None],
                            "responses": ids[:, 1:], "response_mask": ones[:, 1:]}, batch_size=[1])
        if plan is None:
            plan = self.plan_micro_batches(probe, MicroBatchSpec(micro_batch_size_per_gpu=1))
        return self.infer_batch(probe, plan)["log_probs"][0].cpu()

    def save_checkpoint(self, path: str) -> None:
        ckpt.save_checkpoint(path, self.model, self.optimizer, self.scheduler, self._counters(),
                             adapter=self._adapter_record())

    def load_checkpoint(self, path: str) -> None:
        counters = ckpt.load_checkpoint(path, self.model, self.optimizer, self.scheduler,
                                        adapter=self._adapter_record())
        self.global_step = int(counters.get("global_step", 0))
        self.skipped_steps = int(counters.get("skipped_steps", 0))

    def _adapter_record(self) -> dict | None:
        return None if self.adapter is None else self.adapter.record()

    def export_hf(self, path: str) -> None:
        """Write a complete HF model directory (config, weights, tokenizer files) from rank 0. With a
        LoRA adapter: the merged weights there, and the PEFT adapter in `<path>/lora_adapter`."""
        ckpt.export_hf(path, self.model, self.cfg.model_path, adapter=self.adapter)

    def _counters(self) -> dict[str, int]:
        return {"global_step": self.global_step, "skipped_steps": self.skipped_steps}
