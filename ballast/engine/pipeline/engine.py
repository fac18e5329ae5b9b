"""`PipelineEngine`: the engine contract of `TrainEngine`, executed by a pipeline of stages.

The model is cut into ``pp * v`` stages (`ballast.engine.pipeline.stages`, sizes from the FLOPs
model) over a (dp, pp) mesh (`layout`). One mini-batch:

1. preflight, collective over all ranks: the batch's layout, the driver's plan (the mini-batch's
   micro-batches on every DP rank, its pipeline slot, a count the schedule runs: >= pp and a
   multiple of the VPP group), every micro-batch within its slot; any error raises on every rank;
   pipeline peers must hold the same rows; the loss tokens and sequences summed over DP (`GlobalNorm`);
2. every micro-batch packed into its slot (`slots`); all of them go, after the shape guard,
   through one schedule step (`runner`). On the last stage each micro-batch's outputs reach
   ``loss_fn(outputs, micro, norm)``, whose loss is the micro-batch's exact share of the mini-batch
   loss; the schedule does not rescale it, so the stages' gradients are those of the mini-batch loss;
3. gradients summed over each stage's replicas and over the tied copies (`weights`);
4. metrics: from the last stage to its pipeline peers, summed over DP; ``perf/pp_bubble_fraction``
   from the stages' own timelines (time a rank computed nothing / step time, mean over the pipeline
   and replicas) and the cost model's prediction for the same micro-batches beside it.

Forward-only phases (old log-probs, reference, values) run the same schedule without backward;
the last stage's outputs are put back in row order and broadcast to its pipeline peers, so every
rank returns them (the last pipeline rank answers for the replica: what a loss records exists there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from ballast.balance import FlopsModel, MiniBatchPlan, PipelineCostModel
from ballast.balance.pipeline_cost import MicroBatchWork
from ballast.engine.config import EngineConfig, MicroBatchSpec
from ballast.engine.dist import init_distributed, resolve_device_type
from ballast.engine.engine import RESERVED_METRICS, LossFn, TrainEngine, _check_batch, row_index
from ballast.engine.losses import GlobalNorm, MiniBatchStatistic, add_statistic, mini_batch_statistic
from ballast.engine.micro_batch import agree_max, check_rank_plan, plan_rank_micro_batches, restore_order
from ballast.engine.model import load_model
from ballast.engine.optim import build_optimizer, build_scheduler
from ballast.engine.padding import sequence_lengths
from ballast.engine.parallelize import compute_dtype
from ballast.engine.pipeline import store
from ballast.engine.pipeline.layout import PipelineParallelState, build_pipeline_state
from ballast.engine.pipeline.runner import PipelineRunner, StepTimeline
from ballast.engine.pipeline.slots import HeadOptions, PackedMicroBatch, pack_slot, slot_outputs
from ballast.engine.pipeline.stages import StagePlacement, split_model
from ballast.engine.pipeline.weights import FullName, clip_and_step, iter_full_state, sync_gradients


def _tied_names(model) -> tuple[str, ...]:
    """The state-dict names of a tied input embedding / LM head pair, or ()."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is not None and outputs.weight is inputs.weight:
        return ("model.embed_tokens.weight", "lm_head.weight")
    return ()


class PipelineEngine:
    """Load, cut into stages and run one model. Collective: every rank makes the same calls."""

    def __init__(self, cfg: EngineConfig, parallel: PipelineParallelState | None = None, seed: int = 0) -> None:
        if not cfg.pipeline.enabled:
            raise ValueError("PipelineEngine needs pipeline.pp_size > 1 (build_engine picks TrainEngine otherwise)")
        self.cfg = cfg
        device_type = resolve_device_type(cfg.device)
        if parallel is None:
            init_distributed(device_type)
            parallel = build_pipeline_state(cfg.pipeline.pp_size, device_type)
        if parallel.pp_size != cfg.pipeline.pp_size:
            raise ValueError(f"parallel state has pp={parallel.pp_size} but pipeline.pp_size={cfg.pipeline.pp_size}")
        if compute_dtype(cfg, parallel.device_type) != torch.float32:
            raise ValueError("pipeline parallelism computes in fp32 only: set precision='fp32' (the CUDA default "
                             "'auto' is bf16)")
        self.parallel, self.shape = parallel, cfg.pipeline.shape
        model = load_model(cfg.model_path, cfg.role, cfg.trust_remote_code, seed)
        if cfg.enable_activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.workload = FlopsModel.from_hf_config(model.config.to_dict())
        self.cost_model = PipelineCostModel.from_flops(self.workload, self.shape)
        bounds, start = [], 0
        for n in self.cost_model.stage_layers:
            bounds.append((start, start + n))
            start += n
        self.placement = StagePlacement(tuple(bounds), parallel.pp_size)
        self.tied = _tied_names(model) if cfg.role != "critic" else ()
        self._full_names = [FullName(name, tuple(t.shape), t.dtype, self.placement.rank_of(name) if name != "lm_head.weight"
                                     else parallel.pp_size - 1)
                            for name, t in model.state_dict().items()]
        self._model_class = type(model)
        self.stage_indices = self.placement.local_stages(parallel.pp_rank)
        stages = split_model(model, self.placement, parallel.pp_rank, cfg.role == "critic")
        self.model = model.to(parallel.device)  # this rank's stages' weights, under the model's own names
        self.runner = PipelineRunner(stages, self.stage_indices, self.shape, parallel, model.config.hidden_size,
                                     torch.float32)
        self.adapter = None
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim) if cfg.trainable else None
        self.scheduler = build_scheduler(self.optimizer, cfg.optim) if cfg.trainable else None
        self.global_step = 0
        self.skipped_steps = 0
        self.last_micro_batch_tokens: list[list[int]] = []
        self.last_pipeline_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ plans and checks
    def plan_micro_batches(self, data: TensorDict, spec: MicroBatchSpec) -> MiniBatchPlan:
        """A pipeline plan for `data` as this rank holds it (rows already placed). Collective over DP."""
        if spec.bucket_boundaries is not None:
            raise ValueError("bucketed micro-batches do not run through a pipeline engine")
        policy = dataclasses.replace(spec.policy(1), pipeline=self.cost_model)
        return plan_rank_micro_batches(sequence_lengths(data["attention_mask"]).cpu().numpy(), policy,
                                       self.parallel.dp_group, None, self.workload)

    def _plan_error(self, plan: MiniBatchPlan, lengths: np.ndarray) -> str | None:
        error = check_rank_plan(plan, self.parallel.dp_size, self.parallel.dp_rank, lengths)
        if error is not None:
            return error
        if plan.slot_tokens is None:
            return ("the micro-batch plan has no pipeline slot: plan with the engine's pipeline policy "
                    "(MicroBatchPolicy(pipeline=engine.cost_model))")
        if plan.shared_prompts:
            return "shared-prompt plans do not run through a pipeline engine"
        count_error = self.shape.count_error(plan.num_micro_batches)
        if count_error:
            return f"the micro-batch plan cannot run through the {self.shape.schedule} pipeline: {count_error}"
        for j, rows in enumerate(plan.for_rank(self.parallel.dp_rank)):
            tokens = int(lengths[rows].sum())
            if tokens > plan.slot_tokens:
                return (f"micro-batch {j} of DP rank {self.parallel.dp_rank} holds {tokens} tokens, more than the "
                        f"plan's pipeline slot of {plan.slot_tokens}")
        return None

    def _preflight(self, data: TensorDict, plan: MiniBatchPlan) -> tuple[GlobalNorm, tuple, list[int]]:
        """The DP-global normaliser, this rank's micro-batches and their real tokens. Collective over
        every rank: a malformed batch or plan anywhere raises everywhere, before any schedule runs."""
        error = _check_batch(data)
        lengths = None if error else sequence_lengths(data["attention_mask"]).cpu().numpy()
        if error is None:
            error = self._plan_error(plan, lengths) if isinstance(plan, MiniBatchPlan) else \
                f"expected a MiniBatchPlan, got {type(plan).__name__}"
        local_r = 0 if error else int(data["responses"].shape[-1])
        any_error, _ = agree_max([int(error is not None), 0], dist.group.WORLD, self.parallel.device)
        if any_error:
            raise ValueError(error or "another rank received a malformed mini-batch or micro-batch plan")
        response_len = agree_max([local_r], self.parallel.dp_group, self.parallel.device)[0]
        self._check_peers_agree(data)
        counts = torch.tensor([float(data["response_mask"].sum()), float(data.batch_size[0])], dtype=torch.float64,
                              device=self.parallel.device)
        if self.parallel.dp_size > 1:
            dist.all_reduce(counts, group=self.parallel.dp_group)
        norm = GlobalNorm(num_tokens=int(counts[0]), num_sequences=int(counts[1]), response_len=response_len)
        micro = plan.for_rank(self.parallel.dp_rank)
        return norm, micro, [int(lengths[rows].sum()) for rows in micro if len(rows)]

    def _check_peers_agree(self, data: TensorDict) -> None:
        """Pipeline peers must hold identical rows: a fingerprint, compared over the pipeline group."""
        ids = data["input_ids"].to(torch.int64) * data["attention_mask"].to(torch.int64)
        weights = torch.arange(1, ids.shape[-1] + 1, device=ids.device)
        fingerprint = [int(data.batch_size[0]), int((ids * weights).sum()) % (2**61 - 1)]
        both = agree_max(fingerprint + [-v for v in fingerprint], self.parallel.pp_group, self.parallel.device)
        if both[:2] != [-v for v in both[2:]]:
            raise ValueError(f"pipeline peers hold different mini-batches (fingerprints {both[:2]} vs "
                             f"{[-v for v in both[2:]]})")

    def _pack(self, data: TensorDict, micro_batches, slot_tokens: int, head: HeadOptions) -> list[PackedMicroBatch]:
        device = self.parallel.device
        return [pack_slot(data[row_index(rows)].to(device), row_index(rows), slot_tokens, head, self.cfg.attn_backend)
                for rows in micro_batches]

    def _head(self, temperature: float, calculate_entropy: bool) -> HeadOptions:
        return HeadOptions(is_critic=self.cfg.role == "critic", temperature=temperature,
                           calculate_entropy=calculate_entropy, chunk_tokens=self.cfg.logprob_chunk_tokens)

    # ------------------------------------------------------------------ mini-batch execution
    def forward_backward_batch(self, data: TensorDict, loss_fn: LossFn, plan: MiniBatchPlan, forward_only: bool = False,
                               temperature: float = 1.0, calculate_entropy: bool = False) -> dict[str, float]:
        """As `TrainEngine.forward_backward_batch`: gradients of this rank's stages accumulate into
        `.grad`, summed over replicas and tied copies; returns mini-batch metrics. Collective."""
        if not forward_only and not self.cfg.trainable:
            raise ValueError(f"role {self.cfg.role!r} has no optimizer; call with forward_only=True")
        norm, micro_batches, micro_tokens = self._preflight(data, plan)
        head = self._head(temperature, calculate_entropy)
        packed = self._pack(data, micro_batches, plan.slot_tokens, head)
        statistic = mini_batch_statistic(loss_fn)
        if statistic is not None:
            norm = norm.with_stats(self._statistic_sums(statistic, data, packed, plan.slot_tokens))
        sums: dict[str, torch.Tensor] = {"loss": torch.zeros((), dtype=torch.float64, device=self.parallel.device)}

        def share(output: torch.Tensor, j: int) -> torch.Tensor:
            mb = packed[j]
            if not mb.batch_size:
                return output.sum() * 0.0  # an empty slot: zero loss, still through the graph
            micro = data[mb.rows].to(self.parallel.device)
            loss, metrics = loss_fn(slot_outputs(output, mb), micro, norm)
            clash = sorted(set(metrics) & set(RESERVED_METRICS))
            if clash:
                raise ValueError(f"loss_fn returned metrics {clash}, names the engine reserves for itself")
            for key, value in {"loss": loss, **metrics}.items():
                value = torch.as_tensor(value.detach() if torch.is_tensor(value) else value, device=self.parallel.device)
                sums[key] = sums.get(key, 0.0) + value.to(torch.float64)
            return loss

        self.model.train(not forward_only)
        if forward_only:
            with torch.no_grad():
                outputs, timeline = self.runner.run(packed, plan.slot_tokens, head.output_rows, None)
                for j, output in enumerate(outputs):
                    share(output, j)
        else:
            _, timeline = self.runner.run(packed, plan.slot_tokens, head.output_rows, share)
            sync_gradients(dict(self.model.named_parameters()), self.tied, self.parallel)
        last = {key: float(value) for key, value in sums.items()} if self.parallel.is_last else None
        result, self.last_micro_batch_tokens = self._sum_over_dp(self._from_last(last), micro_tokens)
        self.last_pipeline_metrics = self._timeline_metrics(timeline, data, packed)
        result.update(self.last_pipeline_metrics)
        result.update(num_micro_batches=float(len(micro_batches)),
                      num_dummy_micro_batches=float(sum(1 for rows in micro_batches if not len(rows))),
                      num_tokens=float(norm.num_tokens), num_sequences=float(norm.num_sequences))
        return result

    def _statistic_sums(self, statistic: MiniBatchStatistic, data: TensorDict, packed: list[PackedMicroBatch],
                        slot_tokens: int) -> dict[str, float]:
        """The statistic's sums over the whole mini-batch (with outputs: a forward-only schedule step
        under the weights the training step will use, summed on the last stage). Collective."""
        device = self.parallel.device
        total = torch.zeros(len(statistic.keys), dtype=torch.float64, device=device)

        with torch.no_grad():
            if not statistic.needs_outputs:
                if data.batch_size[0]:
                    add_statistic(total, statistic, None, data.to(device))
            else:
                head = dataclasses.replace(packed[0].slot.head, calculate_entropy=False)
                relabelled = [dataclasses.replace(mb, slot=dataclasses.replace(mb.slot, head=head)) for mb in packed]
                self.model.eval()
                outputs, _ = self.runner.run(relabelled, slot_tokens, head.output_rows, None)
                for output, mb in zip(outputs, relabelled):
                    if mb.batch_size:
                        add_statistic(total, statistic, slot_outputs(output, mb), data[mb.rows].to(device))
                dist.broadcast(total, src=self.parallel.last_rank, group=self.parallel.pp_group)
        if self.parallel.dp_size > 1:
            dist.all_reduce(total, group=self.parallel.dp_group)
        return dict(zip(statistic.keys, total.tolist()))

    def _from_last(self, value):
        """`value` of the pipeline's last stage, on every peer. Collective over the pipeline group."""
        box = [value]
        dist.broadcast_object_list(box, src=self.parallel.last_rank, group=self.parallel.pp_group)
        return box[0]

    def _sum_over_dp(self, sums: dict[str, float], micro_tokens: list[int]) -> tuple[dict[str, float], list]:
        return TrainEngine._sum_over_dp(self, sums, micro_tokens)

    def _timeline_metrics(self, timeline: StepTimeline, data: TensorDict, packed: list[PackedMicroBatch]) -> dict:
        """Measured and predicted bubble of this step. Collective over the pipeline and DP groups."""
        device = self.parallel.device
        mine = torch.tensor([timeline.busy_s, timeline.wall_s], dtype=torch.float64, device=device)
        every = [torch.zeros_like(mine) for _ in range(self.parallel.pp_size)]
        dist.all_gather(every, mine, group=self.parallel.pp_group)
        step = max(float(t[1]) for t in every)
        measured = float(np.mean([max(0.0, step - float(t[0])) / step for t in every])) if step > 0 else 0.0
        lengths = sequence_lengths(data["attention_mask"]).cpu().numpy()
        works = [MicroBatchWork.of(lengths[mb.rows.numpy()],
                                   None if not mb.batch_size else [len(mb.slot.keep)]) for mb in packed]
        predicted = self.cost_model.simulate(works).bubble_fraction
        pair = torch.tensor([measured, predicted], dtype=torch.float64, device=device)
        if self.parallel.dp_size > 1:
            dist.all_reduce(pair, group=self.parallel.dp_group)
            pair /= self.parallel.dp_size
        return {"perf/pp_bubble_fraction": float(pair[0]), "perf/pp_bubble_fraction_predicted": float(pair[1])}

    @torch.no_grad()
    def infer_batch(self, data: TensorDict, plan: MiniBatchPlan, temperature: float = 1.0,
                    calculate_entropy: bool = False) -> TensorDict:
        """`log_probs` (+`entropy`) or `values`, (B, R), input row order, on every rank. Collective."""
        _, micro_batches, _ = self._preflight(data, plan)
        head = self._head(temperature, calculate_entropy)
        packed = self._pack(data, micro_batches, plan.slot_tokens, head)
        self.model.eval()
        outputs, _ = self.runner.run(packed, plan.slot_tokens, head.output_rows, None)
        keys = ["values"] if head.is_critic else ["log_probs"] + (["entropy"] if calculate_entropy else [])
        batch, width = data.batch_size[0], data["responses"].shape[1]
        stacked = torch.zeros(len(keys), batch, width, dtype=torch.float32, device=self.parallel.device)
        if self.parallel.is_last and batch:
            per_key = {key: [] for key in keys}
            for output, mb in zip(outputs, packed):
                if mb.batch_size:
                    for key, value in slot_outputs(output, mb).items():
                        per_key[key].append(value)
            real = tuple(rows for rows in micro_batches if len(rows))
            for k, key in enumerate(keys):
                stacked[k] = restore_order(per_key[key], real)
        if batch:
            dist.broadcast(stacked, src=self.parallel.last_rank, group=self.parallel.pp_group)
        return TensorDict({key: stacked[k] for k, key in enumerate(keys)}, batch_size=[batch])

    # ------------------------------------------------------------------ optimizer
    zero_grad = TrainEngine.zero_grad
    lr_scheduler_step = TrainEngine.lr_scheduler_step
    probe_log_probs = TrainEngine.probe_log_probs
    _counters = TrainEngine._counters

    def optimizer_step(self, grad_clip: float | None = None, step_scheduler: bool = True) -> dict[str, float]:
        """As `TrainEngine.optimizer_step`: the norm over every stage (a tied matrix once), the clip,
        the step unless the norm is not finite (then on no rank). Collective over the pipeline."""
        if self.optimizer is None:
            raise ValueError(f"role {self.cfg.role!r} has no optimizer")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip override must be > 0, got {grad_clip}")
        lr = self.optimizer.param_groups[0]["lr"]
        clip = grad_clip if grad_clip is not None else self.cfg.grad_clip
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        once = self.tied[1:] if self.tied else ()  # the head's copy: the embedding's counts
        norm, stepped = clip_and_step(params, once, self.optimizer, self.scheduler if step_scheduler else None, clip,
                                      self.parallel)
        if stepped:
            self.global_step += 1
        else:
            self.skipped_steps += 1
        return {"grad_norm": norm if math.isfinite(norm) else float("nan"), "lr": float(lr),
                "step_skipped": float(not stepped), "skipped_steps": float(self.skipped_steps),
                "global_step": float(self.global_step)}

    # ------------------------------------------------------------------ weights and checkpoints
    def iter_full_state_dict(self, layered: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight of every stage, in the model's state-dict order, on
        every rank (a tied weight under both names). Collective over the pipeline group."""
        yield from iter_full_state(self.model.state_dict(), self._full_names, self.parallel, layered)

    def _require_adapter(self):
        raise ValueError(f"the {self.cfg.role} pipeline engine has no LoRA adapter")

    def iter_adapter_state_dict(self, layered: bool = False):
        self._require_adapter()

    def iter_base_state_dict(self, layered: bool = False):
        self._require_adapter()

    def adapter_disabled(self) -> contextlib.AbstractContextManager:
        self._require_adapter()

    def save_checkpoint(self, path: str) -> None:
        """The stages' weights and optimizer state under the model's names (DCP) and the pipeline
        layout they were saved with. Collective."""
        store.save_checkpoint(path, self.model, self.optimizer, self.scheduler, self._counters(), self.shape,
                              self.placement)

    def load_checkpoint(self, path: str) -> None:
        """Resume what `save_checkpoint` wrote; a checkpoint of another pipeline layout (or none) is
        refused before anything is read. Collective."""
        counters = store.load_checkpoint(path, self.model, self.optimizer, self.scheduler, self.shape, self.placement)
        self.global_step = int(counters.get("global_step", 0))
        self.skipped_steps = int(counters.get("skipped_steps", 0))

    def export_hf(self, path: str) -> None:
        """A complete HF model directory from rank 0, every stage's weights gathered. Collective."""
        store.export_hf(path, self.iter_full_state_dict(), self._model_class, self.model, self.cfg.model_path)
