"""The driver: `RayPPOTrainer.fit()` runs GRPO / PPO steps, one method per phase of the algorithm.

    prompts -> repeat(n, interleave) with a uid per prompt -> generate -> reward -> balance_batch
    -> old log-probs -> ref log-probs -> values -> advantages -> update critic -> update actor
    -> launch the next batch's generation (on the new weights, or k updates behind: off-policy overlap)

Workers do the heavy lifting; everything here is light driver-side math on the Batch.

What this driver leaves out of verl's `RayPPOTrainer.fit`, and why:

1. Two layouts. By default actor, rollout and reference live in one colocated worker group on one
   resource pool (the critic shares its devices) and weight sync stays inside each worker process.
   `trainer.v1.trainer_mode=separate_async` moves the rollout to a pool of its own, the weights
   crossing through the object store after every update (`RolloutWeights`); no per-role pools
   beyond that, no standalone rollout servers.
2. Whole batches, taken in launch order. By default a step trains on samples generated with its
   own weights (exactly train_batch_size x n of them: dynamic sampling, `algorithm.filter_groups`,
   draws more batches until that many are kept). Ballast's `trainer.ballast_overlap.batches_ahead=k`
   generates the next k steps' batches on the same workers while a step trains (`RolloutPipeline`),
   and `separate_async` does the same on the rollout's own pool with verl's window
   (`num_warmup_batches`), its partial rollouts (the trainer's next weights take over the requests in
   flight, each token's version recorded) and its `parameter_sync_step` local updates per step
   (`local_updates`). verl's `colocate_async` (colocated partial rollouts sampled from a replay
   buffer) is refused at start-up (`ballast.trainer.config.off_policy`). Every sample is an agent
   loop (single-turn by default; multi-turn, with tools) on request-level rollout inside the rollout
   workers. Every per-rank size is known at start-up (`DerivedSizes`), so a bad combination fails
   before any worker starts.
3. Rule rewards on the driver; a discriminative reward model (`reward.reward_model.enable`) scores
   the whole batch once generated, on resident workers planned like every forward-only phase
   (`ballast.trainer.step.reward_model`). No generative judge and no ReMax baseline generation.
4. Old log-probs come from the actor, unless rollout correction's bypass mode takes the rollout
   engine's; where they come from is one value decided at start-up (`OldLogProbSource`,
   `ballast.trainer.step.old_log_probs`), which also owns the parsed rollout-correction settings.
   The rollout's own log-probs, when requested, feed the mismatch metrics (`rollout_corr/*`,
   `training/rollout_actor_log_prob_diff`) and the correction.
5. No profiler hooks, rollout dumps or preemption handling in the loop: checkpoints at `save_freq`
   and at the last step, and `resume_mode=auto`, cover restarts.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from tqdm import tqdm

from ballast.balance import FlopsModel, PhasePlan, balance_metrics, workload_costs
from ballast.protocol import Batch, Output
from ballast.trainer.algorithms import make_kl_controller
from ballast.trainer.algorithms.policy_loss import actor_constant_metrics
from ballast.trainer.run.builders import actor_loss_config
from ballast.trainer.step.charts import per_rank_tokens
from ballast.trainer.run.checkpoints import CheckpointManager, ResumePoint, rng_state, set_rng_state
from ballast.trainer.config import BallastConfig, DerivedSizes
from ballast.trainer.run.data import DataExhausted, RunData
from ballast.trainer.step.dynamic_sampling import DynamicSamplingError, GroupCollector  # noqa: F401 (re-exported)
from ballast.trainer.step.metrics import data_metrics, rollout_probs_diff_metrics, throughput_metrics, timing_metrics
from ballast.trainer.step.monitor import BalanceMonitor, micro_batch_metrics, rank_load_metrics
from ballast.trainer.step.old_log_probs import OldLogProbSource, old_log_prob_metrics, run_pass, take_from_update
from ballast.trainer.step.plans import StepPlanner, epoch_partitions, plan_metrics, row_lengths
from ballast.workers.actor_rollout_ref import GENERATE_SECONDS_METRIC
from ballast.workers.spec import GenerateArgs
from ballast.trainer.step.rollout_recovery import RECOVERIES_METRIC, RECOVERY_SECONDS_METRIC, rollout_recovery
from ballast.workers.weight_sources import PARTIAL_LOADS_METRIC, SERVED_VERSION_METRIC, UPDATE_WEIGHTS_METRIC
from ballast.workers.sync_check import METRIC_PREFIX as SYNC_CHECK_PREFIX
from ballast.workers.agent_loop.metrics import agent_metrics
from ballast.workers.rollout.base import validation_call_index
from ballast.trainer.step.reward import RewardManager
from ballast.trainer.run.workers import Workers
from ballast.trainer.run.tracking import Tracker, format_validation, progress_postfix
from ballast.trainer.step.val_metrics import validation_metrics
from ballast.trainer.run import fault_injection, signals
from ballast.trainer.step.rollout_correction import RolloutCorrectionPhase
from ballast.trainer.step.advantage_phase import rewards_and_advantages
from ballast.trainer.step.rollout_weights import RolloutWeights
from ballast.trainer.step.rollout_pipeline import (PendingRollout, Rollout, RolloutPipeline, idle_metrics,
                                                   load_rollouts_ahead, save_rollouts_ahead, staleness_metrics)
from ballast.trainer.config.off_policy import overlap
from ballast.trainer.step.local_updates import merge_local_metrics, share_rows


# Rollout call indices (sampling seeds) of the extra generation batches of dynamic sampling.
EXTRA_GENERATION_CALL_STRIDE = 1 << 24


@dataclass
class LocalUpdate:
    """One local update of a step: its rows, the actor's plan and results (None without an actor update)
    and its metrics, which the rollout-correction figures join once the next batches are launched."""

    batch: Batch
    actor_plan: Optional[PhasePlan]
    results: Optional[Sequence]
    metrics: Dict[str, float]


class NonFiniteStepsError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite gradient norm."""


class RayPPOTrainer:
    def __init__(self, cfg: BallastConfig, sizes: DerivedSizes, data: RunData, workers: Workers,
                 reward: RewardManager, tracker: Tracker, model_config: dict,
                 old_log_probs: OldLogProbSource) -> None:
        self.cfg, self.sizes, self.data, self.workers = cfg, sizes, data, workers
        self.reward, self.tracker = reward, tracker
        self.ckpt = CheckpointManager(cfg.trainer.default_local_dir, cfg.trainer.max_actor_ckpt_to_keep)
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        workload = cfg.trainer.balance_workload
        self.workload = FlopsModel.from_hf_config(model_config) if workload == "flops" else workload
        self.total_steps = data.total_steps
        # decided once at start-up (`RunPlan.old_log_probs`), with the rollout-correction settings
        self.old_log_probs = old_log_probs
        self.actor_loss_cfg = actor_loss_config(cfg, old_log_probs)
        self.correction = RolloutCorrectionPhase(old_log_probs.correction)
        self.global_step = 0
        self._nonfinite_in_a_row = 0
        self._pending_metrics: Dict[str, float] = {}  # measured after a step's row was logged
        self._step_clock = time.perf_counter()
        self.overlap = overlap(cfg)
        self.rollouts = RolloutPipeline(self.data.next_prompts, self.launch_rollout, self.finish_rollout,
                                        self.overlap.batches_ahead, self.total_steps)
        # separate_async: the weights travel to the rollout pool
        self.rollout_weights = RolloutWeights(workers, rollout_recovery(workers, cfg.trainer.ballast_rollout_recovery))
        self.monitor = BalanceMonitor(tracker, self.total_steps, cfg.trainer.enable_monitor,
                                      cfg.trainer.monitor_interval, sizes.actor.token_budget(sizes.actor.train))
        self.resumed_from: Optional[str] = None  # the checkpoint `resume` loaded

    # ------------------------------------------------------------------ the loop
    def fit(self) -> Dict[str, float]:
        """Train from `global_step` (0, or where `resume` left it) to the last step."""
        self.tracker.rewind(self.global_step)
        self._weights_version = self.global_step  # updates the actor's weights have seen
        self.rollout_weights.export(self.global_step)  # a rollout pool starts from the trainer's (resumed) weights
        t = self.cfg.trainer
        last: Dict[str, float] = {}
        if t.val_only:  # verl: validate the current (possibly resumed) policy once, no training
            metrics = self.validate()
            self.tracker.log(metrics, step=self.global_step)
            return metrics
        if t.val_before_train and self.data.val is not None and self.global_step == 0:
            val = self.validate()
            self.tracker.console(format_validation(val, 0))
            self.tracker.log(val, step=0)
        bar = tqdm(total=self.total_steps, initial=self.global_step, desc="training", unit="step", dynamic_ncols=True)
        try:
            while self.global_step < self.total_steps:
                self._step_clock = time.perf_counter()  # validation and checkpoints are not part of a step
                step = self.global_step + 1
                try:
                    metrics = self.train_step(step)
                except DataExhausted as end:
                    self.end_of_data(end)
                    break
                metrics.update(self._pending_metrics)
                self._pending_metrics = {}
                self.global_step = step
                if self.data.val is not None and t.test_freq > 0 and (step % t.test_freq == 0 or step == self.total_steps):
                    timing: Dict[str, float] = {}
                    with _timer(timing, "testing"):
                        metrics.update(self.validate())
                    metrics["timing_s/testing"] = timing["testing"]
                    self.tracker.console(format_validation(metrics, step))
                # Log before saving: a crash during the save then loses no metrics row (a resume
                # drops the rows after its checkpoint and produces them again).
                self.tracker.log(metrics, step=step)
                saved = t.save_freq > 0 and (step % t.save_freq == 0 or step == self.total_steps)
                if saved:
                    start = time.perf_counter()
                    self.save_checkpoint()
                    # logged with the next step's row: this one is already written (see above)
                    self._pending_metrics["timing_s/save_checkpoint"] = time.perf_counter() - start
                if signals.pending() is not None:  # trainer.save_on_signal: this step was the safe point
                    if not saved:
                        self.save_checkpoint()
                    signals.raise_pending()
                bar.set_postfix(progress_postfix(metrics), refresh=False)
                bar.update(1)
                last = metrics
        finally:
            bar.close()
            self.rollouts.close()
        return last

    def train_step(self, step: int) -> Dict[str, float]:
        """One step on the batch the rollout pipeline generated for it. `timing_s/step` is the loop's wall
        time for the step: its batch's generation and scoring, where they did not overlap the previous
        step, count toward it, validation and checkpoints do not."""
        timing: Dict[str, float] = {}
        metrics: Dict[str, float] = {}
        with _timer(timing, "step", start=self._step_clock):
            rollout, timing["wait_rollout"] = self.rollouts.take(step)
            with _timer(timing, "wait_rollout"):  # dynamic sampling's further batches: the trainer waits too
                rollout = self.fill_groups(rollout)
            batch = rollout.batch
            timing.update(rollout.timing)
            metrics.update(rollout.metrics)
            updates_actor = actor_updates_at(step, self.cfg.trainer.critic_warmup)
            updates = self.local_updates(batch, updates_actor, timing, metrics)
            fault_injection.kill_point("updated", step)
            # The weights of this step are final: the next batches generate from here on (module docstring).
            self._weights_version = step
            if self.rollout_weights.split:
                with _timer(timing, "export_weights"):
                    self.rollout_weights.export(step)
            self.rollouts.launch_through(step + 1 + self.rollouts.ahead)
            fault_injection.kill_point("generating", step)
            with _timer(timing, "rollout_corr"):
                for u in updates:
                    u.metrics.update(self.correction.after_update(u.batch, u.actor_plan, u.results))
            metrics.update(merge_local_metrics([u.metrics for u in updates], [len(u.batch) for u in updates]))
            batch = updates[0].batch if len(updates) == 1 else Batch.concat([u.batch for u in updates])
        actor_key = self.old_log_probs.actor_column
        metrics.update(old_log_prob_metrics(batch, self.actor_loss_cfg, actor_key))
        metrics.update(data_metrics(batch, self.cfg.data.max_response_length, self.sizes.use_critic))
        metrics.update(agent_metrics(batch.non_tensors))  # turns, tools, stop reasons
        self.monitor.report(step)
        metrics.update(timing_metrics(batch, timing))
        metrics.update(idle_metrics(timing))
        if self.rollouts.ahead:
            metrics.update(staleness_metrics(rollout, step))
        metrics.update(rollout_probs_diff_metrics(batch, actor_key))
        metrics.update(throughput_metrics(batch, timing["step"], self.workers.num_devices))
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.data.epoch)
        return metrics

    def local_updates(self, batch: Batch, updates_actor: bool, timing: Dict[str, float],
                      metrics: Dict[str, float]) -> List["LocalUpdate"]:
        """The step's local updates on `batch` (verl's `parameter_sync_step`; one for every other mode,
        `ballast.trainer.step.local_updates`): first the old log-probs of every row under the step's
        starting weights (verl restores them for each later local update) and the reference's, over the
        whole batch; then each share's own plans, values, advantages and updates. Returns each update's
        record, in row order (its batch: the share, with what it computed)."""
        whole = StepPlanner(self.cfg, self.sizes, self.workload, batch, self.global_step, self.workers.objectives)
        separate_pass = self.old_log_probs.runs_pass(updates_actor)
        if separate_pass:
            with _timer(timing, "balance"):
                pass_plan = whole.inference("actor")
            with _timer(timing, "old_log_prob"):
                metrics.update(run_pass(self.workers.actor_rollout, batch, pass_plan))
        if self.sizes.use_reference:
            with _timer(timing, "ref"):
                self.infer(batch, self.workers.actor_rollout.compute_ref_log_prob, whole.inference("ref"))
        shares = share_rows(batch["uid"], self.overlap.local_updates)
        if len(shares) == 1:
            return [self.local_update(batch, whole, updates_actor, separate_pass, timing)]
        updates = []
        for rows in shares:
            part = batch[rows]
            plans = StepPlanner(self.cfg, self.sizes, self.workload, part, self.global_step, self.workers.objectives)
            updates.append(self.local_update(part, plans, updates_actor, separate_pass, timing))
        return updates

    def local_update(self, batch: Batch, plans: StepPlanner, updates_actor: bool, separate_pass: bool,
                     timing: Dict[str, float]) -> "LocalUpdate":
        """One PPO update on `batch` (a share of the step, or all of it): values, advantages, critic and
        actor update, each phase planned over these rows."""
        metrics: Dict[str, float] = {}
        with _timer(timing, "balance"):
            actor_plan = plans.update("actor") if updates_actor else None
            metrics.update(self.dp_split_metrics(batch, plans.inference("actor") if separate_pass else actor_plan))
        if self.sizes.use_critic:
            with _timer(timing, "values"):
                self.infer(batch, self.workers.critic.compute_values, plans.inference("critic"))
        metrics.update(rewards_and_advantages(batch, self.cfg.algorithm, self.kl_ctrl, self.correction,
                                              lambda name: _timer(timing, name), self.old_log_probs.column))
        if self.sizes.use_critic:
            with _timer(timing, "update_critic"):
                critic_plan = plans.update("critic")
                result = self.workers.critic.update_critic(batch[critic_plan.rows], critic_plan)[0]
                metrics.update(result.metrics, **plan_metrics(critic_plan, "critic"))
        results = None
        if updates_actor:
            with _timer(timing, "update_actor"):
                actor_metrics, results = self.update_actor(batch, actor_plan, plans, separate_pass)
                metrics.update(actor_metrics)
        return LocalUpdate(batch, actor_plan, results, metrics)

    @staticmethod
    def infer(batch: Batch, call, plan: PhasePlan) -> None:
        """Run an inference phase on `batch[plan.rows]` and add its outputs to `batch`, in row order."""
        out = call(batch[plan.rows], plan)
        index = torch.as_tensor(plan.restore_index())
        for key in out.tensor_keys:
            batch[key] = out[key][index]

    # ------------------------------------------------------------------ phases
    def launch_rollout(self, step: int, prompts: Batch) -> PendingRollout:
        """Repeat step's prompts n times each (adjacent, same uid) and submit their generation without
        waiting (main thread: this fixes the weights that generate them, see RolloutPipeline)."""
        batch = prompts.repeat(self.cfg.actor_rollout_ref.rollout.n, interleave=True)
        future = self.rollout_weights.submit(batch, GenerateArgs(call_index=step))
        return PendingRollout(step, self._weights_version, future, time.perf_counter())

    def finish_rollout(self, pending: PendingRollout) -> Rollout:
        """Wait for a launched generation and score it (helper thread). With algorithm.filter_groups only
        the informative groups are kept; a batch that leaves the step short is returned `unfilled`, and
        `fill_groups` generates the rest when the step is taken."""
        step = pending.step
        timing: Dict[str, float] = {}
        metrics: Dict[str, float] = {}
        batch = self._generated(pending.future.get(), timing, metrics)
        timing["gen"] = time.perf_counter() - pending.start
        with _timer(timing, "reward"):
            extras = self._score(batch, step)
        fg = self.cfg.algorithm.filter_groups
        if not fg.enable:
            metrics.update(_extra_means(extras))
            return Rollout(step, pending.version, batch, timing, metrics)
        collector = GroupCollector(fg.metric, self.cfg.data.train_batch_size, self.cfg.actor_rollout_ref.rollout.n,
                                   fg.max_num_gen_batches, self.data.pad_token_id)
        rollout = Rollout(step, pending.version, None, timing, metrics, unfilled=collector)
        return _collected(rollout) if collector.add(batch, extras, pending.version) else rollout

    def fill_groups(self, rollout: Rollout) -> Rollout:
        """DAPO's dynamic sampling: generate further batches until train_batch_size informative groups are
        collected. Runs on the main thread when the step is taken, so the extra batches sample with the
        latest weights (each row's version is recorded: with batches generated ahead, the step mixes
        ages up to the staleness bound) and draw prompts at a fixed point of the loop: a run, and a
        resumed run, draw the same prompts."""
        collector, step = rollout.unfilled, rollout.step
        if collector is None:
            return rollout
        while not collector.full:
            num_gen = collector.num_gen_batches
            try:
                prompts = self.data.next_prompts(step, uid_prefix=f"step{step}.gen{num_gen}")
            except DataExhausted as end:
                raise DataExhausted(f"{end}; the {collector.progress()} collected from {num_gen} generation "
                                    "batches are not trained on") from None
            with _timer(rollout.timing, "gen"):
                more = prompts.repeat(self.cfg.actor_rollout_ref.rollout.n, interleave=True)
                index = step + num_gen * EXTRA_GENERATION_CALL_STRIDE
                out = self.rollout_weights.generate(more, GenerateArgs(call_index=index))
                batch = self._generated(out, rollout.timing, rollout.metrics)
            with _timer(rollout.timing, "reward"):
                extras = self._score(batch, step)
            collector.add(batch, extras, self._weights_version)
        return _collected(rollout)

    @staticmethod
    def _generated(out: Output, timing: Dict[str, float], metrics: Dict[str, float]) -> Batch:
        """A generation's batch; its weight sync's seconds (the slowest worker's, part of timing_s/gen and
        also reported alone, as verl does) and the weight-sync check's figures (LoRA runs: the worst
        worker's) go into `timing` / `metrics`."""
        sync_s = max(out.metrics.get(UPDATE_WEIGHTS_METRIC, []), default=0.0)
        if sync_s:
            timing["update_weights"] = timing.get("update_weights", 0.0) + sync_s
        metrics.update({k: max(v) for k, v in out.metrics.items()
                        if (k.startswith(SYNC_CHECK_PREFIX) or k == PARTIAL_LOADS_METRIC) and v})
        # replacements of the rollout pool (driver) and engines rebuilt in place (workers), 0 when none
        metrics[RECOVERIES_METRIC] = metrics.get(RECOVERIES_METRIC, 0.0) + sum(out.metrics.get(RECOVERIES_METRIC, []))
        recovery_s = sum(out.metrics.get(RECOVERY_SECONDS_METRIC, []))
        if recovery_s:
            timing["rollout_recovery"] = timing.get("rollout_recovery", 0.0) + recovery_s
        served = out.metrics.get(SERVED_VERSION_METRIC)
        if served:
            metrics[f"{SERVED_VERSION_METRIC}/min"] = min(served)
        busy = out.metrics.get(GENERATE_SECONDS_METRIC)
        if busy:
            timing["gen_workers"] = timing.get("gen_workers", 0.0) + max(busy)
        return out.batch

    def _score(self, batch: Batch, step: int) -> Dict[str, np.ndarray]:
        scores, extras = self.reward(batch, step=step)
        batch["token_level_scores"] = scores
        return extras

    def dp_split_metrics(self, batch: Batch, plan: PhasePlan) -> Dict[str, float]:
        """verl's raw vs balanced sequence-length metrics: the contiguous split of the step as generated
        against the DP split `plan` runs (its first epoch), plus per-rank load figures."""
        lengths = row_lengths(batch)
        dp = plan.dp_size
        partitions = epoch_partitions(plan)
        metrics = balance_metrics(lengths, workload_costs(lengths, self.workload), partitions, dp)
        if not self.cfg.trainer.balance_batch:  # the split is the contiguous one: report it only
            metrics = {k: v for k, v in metrics.items() if "balanced" not in k}
        raw, balanced = per_rank_tokens(lengths, partitions, dp)
        metrics.update(rank_load_metrics(raw, balanced))
        self.monitor.record_balance(lengths, raw, balanced, dp)
        return metrics

    def update_actor(self, batch: Batch, plan: PhasePlan, plans: StepPlanner, separate_pass: bool):
        """The actor update on `batch[plan.rows]`: (metrics, every DP rank's `UpdateResult`). When the
        update computed the old log-probs, they and their entropies are written into `batch`."""
        mode = self.old_log_probs.update_mode(separate_pass)
        rest = plans.after_first_mini_batch(plan) if mode.from_update else None
        results = self.workers.actor_rollout.update_actor(batch[plan.rows], plan, mode, rest)
        if mode.from_update:
            take_from_update(batch, results, plan)
        metrics = dict(results[0].metrics)
        metrics.update(plan_metrics(plan, "actor"))
        metrics.update(actor_constant_metrics(self.actor_loss_cfg))
        micro_tokens = results[0].micro_batch_tokens
        self.monitor.record_micro_tokens(micro_tokens)
        metrics.update(micro_batch_metrics(micro_tokens))
        if metrics.get("actor/step_skipped", 0.0) >= 1.0:
            self._nonfinite_in_a_row += 1
            limit = self.cfg.trainer.max_consecutive_nonfinite_steps
            if self._nonfinite_in_a_row >= limit:
                raise NonFiniteStepsError(
                    f"{self._nonfinite_in_a_row} actor updates in a row had a non-finite gradient norm and were "
                    f"skipped (trainer.max_consecutive_nonfinite_steps={limit}); check the learning rate and data"
                )
        else:
            self._nonfinite_in_a_row = 0
        metrics["perf/num_micro_batches"] = metrics.pop("actor/num_micro_batches", float("nan"))
        return metrics, results

    def validate(self) -> Dict[str, float]:
        """Answer every validation prompt `val_kwargs.n` times; verl's val-core/val-aux metrics per data
        source, plus the overall mean score and response length."""
        val = self.data.val.repeat(self.cfg.actor_rollout_ref.rollout.val_kwargs.n, interleave=True)
        outputs = []
        for i, chunk in enumerate(val.split(self.data.val_batch_size or len(val))):
            call = GenerateArgs(call_index=validation_call_index(self.global_step, i), validate=True)
            outputs.append(self.rollout_weights.generate(chunk, call).batch)
        out = Batch.concat(outputs) if len(outputs) > 1 else outputs[0]
        scores, extras = self.reward(out)
        per_sample = scores.sum(-1).numpy()
        sources = np.asarray(out["data_source"]).astype(str)
        infos = {"reward": per_sample.tolist(), **{k: v.tolist() for k, v in extras.items()}}
        metrics = validation_metrics(sources, np.asarray(out["uid"]).astype(str), infos)
        metrics["val/score/mean"] = float(per_sample.mean())
        metrics["val/response_length/mean"] = float(out["response_mask"].sum(-1).float().mean())
        metrics.update(agent_metrics(out.non_tensors, prefix="val/"))
        return metrics

    def end_of_data(self, end: DataExhausted) -> None:
        """The data of trainer.total_epochs ran out before the next step was complete: say so, and
        checkpoint the last trained step when trainer.save_freq asks for checkpoints and it has none
        (verl's DAPO recipe also ends here and saves its last step)."""
        done = self.global_step
        self.tracker.console(f"ballast: {end}: training stops after step {done} of the {self.total_steps} planned")
        t = self.cfg.trainer
        if t.save_freq > 0 and done > 0 and done % t.save_freq != 0:
            self.save_checkpoint()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> str:
        def save_workers(path: str) -> None:
            self.workers.actor_rollout.save_checkpoint(path)
            # A complete Hugging Face directory of the actor, loadable without Ballast (or by vLLM).
            self.workers.actor_rollout.export_hf(os.path.join(path, "actor_hf"))
            if self.workers.critic is not None:
                self.workers.critic.save_checkpoint(path)
            save_rollouts_ahead(path, ahead)

        ahead = self.rollouts.saved_ahead(self.global_step + 1)  # waits for their generation and scoring
        state = {"dataloader": self.data.state_dict(), "kl_coef": self.kl_ctrl.value, "rng": rng_state(),
                 "nonfinite_in_a_row": self._nonfinite_in_a_row}
        return self.ckpt.save(self.global_step, save_workers, state)

    def resume(self, point: ResumePoint) -> Optional[str]:
        """Load `point` (resolved and verified before Ray started, see `ballast.trainer.run.preflight`): the
        workers' state and the driver's. Returns the checkpoint loaded, None for a fresh start."""
        if point.fresh:
            return None
        state = CheckpointManager.read_state(point.checkpoint)
        assert int(state["global_step"]) == point.step, (point, state["global_step"])  # resolved from this file
        self.workers.actor_rollout.load_checkpoint(point.checkpoint)
        if self.workers.critic is not None:
            self.workers.critic.load_checkpoint(point.checkpoint)
        self.global_step = point.step
        self.data.load_state_dict(state["dataloader"])  # past the prompts of every step launched ahead
        self.rollouts.restore(load_rollouts_ahead(point.checkpoint))
        self.kl_ctrl.value = float(state["kl_coef"])
        self._nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        set_rng_state(state["rng"])
        print(f"ballast: resumed from {point.checkpoint} at step {self.global_step}")
        self.resumed_from = point.checkpoint
        return point.checkpoint


def _collected(rollout: Rollout) -> Rollout:
    """`rollout` with its full collector's batch, per-row versions and sampling metrics."""
    collector = rollout.unfilled
    batch, extras, sampling = collector.result()
    rollout.metrics.update(_extra_means(extras))
    rollout.metrics.update(sampling)
    rollout.batch, rollout.versions, rollout.unfilled = batch, collector.row_versions(), None
    return rollout


def _extra_means(extras: Dict[str, np.ndarray]) -> Dict[str, float]:
    return {f"reward_extra/{k}/mean": float(v.mean()) for k, v in extras.items() if np.issubdtype(v.dtype, np.number)}


def actor_updates_at(step: int, critic_warmup: int) -> bool:
    """verl's rule: the actor trains from step `critic_warmup` on (steps count from 1), so
    critic_warmup=W trains only the critic on steps 1..W-1 and critic_warmup <= 1 changes nothing."""
    return step >= critic_warmup


@contextlib.contextmanager
def _timer(timing: Dict[str, float], name: str, start: Optional[float] = None):
    start = time.perf_counter() if start is None else start
    try:
        yield
    finally:  # summed: dynamic sampling generates (and scores) several batches in one step
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start
