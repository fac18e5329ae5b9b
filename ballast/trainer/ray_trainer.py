"""The driver: `RayPPOTrainer.fit()` runs GRPO / PPO steps, one method per phase of the algorithm.

    prompts -> repeat(n, interleave) with a uid per prompt -> generate -> reward -> balance_batch
    -> old log-probs -> ref log-probs -> values -> advantages -> update critic -> update actor

Workers do the heavy lifting; everything here is light driver-side math on the Batch.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Dict, Optional

import numpy as np
from tqdm import tqdm

from ballast.balance import FlopsModel, balance_batch
from ballast.protocol import Batch
from ballast.trainer.algorithms import get_adv_estimator, kl_penalty, make_kl_controller, masked_mean
from ballast.trainer.charts import per_rank_tokens, save_balance_chart
from ballast.trainer.checkpointing import CheckpointManager, rng_state, set_rng_state
from ballast.trainer.config import BallastConfig, DerivedSizes
from ballast.trainer.data_setup import RunData
from ballast.trainer.metrics import data_metrics, pop_worker_timing, throughput_metrics, timing_per_token_metrics
from ballast.trainer.monitor import (
    DynamicBatchVisualizer, balancer_line, micro_batch_metrics, monitor_lines, rank_load_metrics, should_report,
)
from ballast.workers.on_policy import is_on_policy
from ballast.workers.train_loop import MICRO_TOKENS_KEY
from ballast.trainer.reward import RewardManager
from ballast.trainer.roles import Workers
from ballast.trainer.tracking import Tracker

VALIDATION_CALL_OFFSET = 1 << 30  # rollout call indices of validation passes never meet training ones


class NonFiniteStepsError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite gradient norm."""


class RayPPOTrainer:
    def __init__(self, cfg: BallastConfig, sizes: DerivedSizes, data: RunData, workers: Workers,
                 reward: RewardManager, tracker: Tracker, model_config: dict) -> None:
        self.cfg, self.sizes, self.data, self.workers = cfg, sizes, data, workers
        self.reward, self.tracker = reward, tracker
        self.ckpt = CheckpointManager(cfg.trainer.default_local_dir, cfg.trainer.max_actor_ckpt_to_keep)
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        workload = cfg.trainer.balance_workload
        self.workload = FlopsModel.from_hf_config(model_config) if workload == "flops" else workload
        self.total_steps = data.total_steps
        # One mini-batch, one epoch: no separate old-log-prob pass (see ballast.workers.on_policy).
        self.on_policy = is_on_policy(sizes.actor.num_mini_batches, cfg.actor_rollout_ref.actor.ppo_epochs,
                                      cfg.algorithm.use_kl_in_reward)
        self.global_step = 0
        self._nonfinite_in_a_row = 0
        self._step_view: Dict[str, object] = {}  # what the monitor needs from the current step
        self.visualizer = None
        if cfg.trainer.enable_monitor:
            self.visualizer = DynamicBatchVisualizer(
                os.path.join(tracker.run_dir, "dynamic_batch_plots"), plot_interval=cfg.trainer.monitor_interval,
                token_budget=sizes.actor.train.micro_token_budget)
        self._resumed_from: Optional[str] = None
        self._resume_checked = False

    # ------------------------------------------------------------------ the loop
    def fit(self) -> Dict[str, float]:
        self.resume()
        self.tracker.rewind(self.global_step)
        t = self.cfg.trainer
        last: Dict[str, float] = {}
        if t.val_before_train and self.data.val is not None and self.global_step == 0:
            self.tracker.log(self.validate(), step=0)
        bar = tqdm(total=self.total_steps, initial=self.global_step, desc="training", unit="step", dynamic_ncols=True)
        try:
            while self.global_step < self.total_steps:
                step = self.global_step + 1
                metrics = self.train_step(self.data.next_prompts(step), step)
                self.global_step = step
                if self.data.val is not None and t.test_freq > 0 and (step % t.test_freq == 0 or step == self.total_steps):
                    metrics.update(self.validate())
                # Log before saving: a crash during the save then loses no metrics row (a resume
                # drops the rows after its checkpoint and produces them again).
                self.tracker.log(metrics, step=step)
                if t.save_freq > 0 and (step % t.save_freq == 0 or step == self.total_steps):
                    self.save_checkpoint()
                bar.update(1)
                bar.set_postfix({k.split("/")[-2] if k.endswith("mean") else k.split("/")[-1]: f"{metrics[k]:.3f}"
                                 for k in ("critic/score/mean", "actor/pg_loss") if k in metrics})
                last = metrics
        finally:
            bar.close()
        return last

    def train_step(self, prompts: Batch, step: int) -> Dict[str, float]:
        timing: Dict[str, float] = {}
        metrics: Dict[str, float] = {}
        with _timer(timing, "step"):
            with _timer(timing, "gen"):
                batch = self.generate(prompts, step)
            timing.update(pop_worker_timing(batch))
            with _timer(timing, "reward"):
                metrics.update(self.compute_reward(batch))
            with _timer(timing, "balance"):
                metrics.update(self.balance(batch, step))
            if not self.on_policy:  # on-policy: the update's own forward supplies them
                with _timer(timing, "old_log_prob"):
                    metrics.update(self.compute_old_log_probs(batch))
            if self.sizes.use_reference:
                with _timer(timing, "ref"):
                    batch = batch.union(self.workers.actor_rollout.compute_ref_log_prob(batch))
            if self.sizes.use_critic:
                with _timer(timing, "values"):
                    batch = batch.union(self.workers.critic.compute_values(batch))
            with _timer(timing, "adv"):
                metrics.update(self.compute_advantages(batch))
            if self.sizes.use_critic:
                with _timer(timing, "update_critic"):
                    critic_metrics = self.workers.critic.update_critic(batch)[0]
                    critic_metrics.pop(MICRO_TOKENS_KEY, None)
                    metrics.update(critic_metrics)
            if step > self.cfg.trainer.critic_warmup:
                with _timer(timing, "update_actor"):
                    metrics.update(self.update_actor(batch))
        metrics.update(data_metrics(batch, self.cfg.data.max_response_length, self.sizes.use_critic))
        self.report_monitor(step)
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        metrics.update(throughput_metrics(batch, timing["step"], self.workers.world_size))
        metrics.update(timing_per_token_metrics(batch, timing))
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.data.epoch)
        return metrics

    # ------------------------------------------------------------------ phases
    def generate(self, prompts: Batch, step: int) -> Batch:
        """Repeat each prompt n times (adjacent, same uid) on the driver, then generate."""
        batch = prompts.repeat(self.cfg.actor_rollout_ref.rollout.n, interleave=True)
        batch.meta["rollout_call_index"] = step
        out = self.workers.actor_rollout.generate_sequences(batch)
        out.meta.pop("rollout_call_index", None)
        return out

    def compute_reward(self, batch: Batch) -> Dict[str, float]:
        scores, extras = self.reward(batch)
        batch["token_level_scores"] = scores
        return {f"reward_extra/{k}/mean": float(v.mean()) for k, v in extras.items()}

    def balance(self, batch: Batch, step: int) -> Dict[str, float]:
        """Reorder so that the contiguous dp split gives every rank a similar workload (in place)."""
        lengths = batch["attention_mask"].sum(-1).numpy()
        dp = self.sizes.actor.dp_size
        groups = batch["uid"] if self.cfg.trainer.balance_keep_groups else None
        plan = balance_batch(lengths, dp, workload=self.workload, group_ids=groups)
        if self.cfg.trainer.balance_batch:
            batch.reorder(plan.order)
            metrics = dict(plan.metrics)
        else:  # report what balancing would have done, but keep the order
            metrics = {k: v for k, v in plan.metrics.items() if "balanced" not in k}
        raw, balanced = per_rank_tokens(lengths, plan.partitions, dp)
        if not self.cfg.trainer.balance_batch:
            balanced = raw
        metrics.update(rank_load_metrics(raw, balanced))
        self._step_view = {"lengths": lengths, "raw": raw, "balanced": balanced, "dp": dp}
        if step == 1 or step % 10 == 0 or step == self.total_steps:
            path = os.path.join(self.tracker.run_dir, "charts", f"balance_step_{step}.png")
            self.tracker.log_images({"balance/per_rank_tokens": save_balance_chart(path, raw, balanced, step)}, step)
        return metrics

    def compute_old_log_probs(self, batch: Batch) -> Dict[str, float]:
        out = self.workers.actor_rollout.compute_log_prob(batch)
        entropy = out.pop("entropy")["entropy"]
        batch["old_log_probs"] = out["old_log_probs"]
        metrics = {"actor/entropy": float(masked_mean(entropy, batch["response_mask"]))}
        metrics.update({k: float(np.mean(v)) for k, v in out.meta.get("metrics", {}).items() if v})
        if "rollout_log_probs" in batch:
            # The rollout engine's log-probs of its own samples against the actor's: a direct check
            # that weight sync after every update keeps the two models identical.
            mask = batch["response_mask"].bool()
            diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()[mask]
            metrics["training/rollout_actor_log_prob_diff/mean"] = float(diff.mean()) if diff.numel() else 0.0
            metrics["training/rollout_actor_log_prob_diff/max"] = float(diff.max()) if diff.numel() else 0.0
        return metrics

    def compute_advantages(self, batch: Batch) -> Dict[str, float]:
        alg = self.cfg.algorithm
        metrics: Dict[str, float] = {}
        mask = batch["response_mask"].float()
        rewards = batch["token_level_scores"]
        if alg.use_kl_in_reward:
            kld = kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], alg.kl_penalty) * mask
            rewards = rewards - self.kl_ctrl.value * kld
            current_kl = float(masked_mean(kld, mask, dim=-1).mean())  # per-sequence mean, then batch mean
            self.kl_ctrl.update(current_kl, n_steps=len(batch))
            metrics.update({"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": self.kl_ctrl.value})
        batch["token_level_rewards"] = rewards
        adv, returns = get_adv_estimator(alg.adv_estimator)(
            token_level_rewards=rewards, response_mask=mask, index=batch["uid"],
            values=batch["values"] if "values" in batch else None, gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        )
        batch["advantages"], batch["returns"] = adv, returns
        return metrics

    def update_actor(self, batch: Batch) -> Dict[str, float]:
        metrics = self.workers.actor_rollout.update_actor(batch)[0]
        micro_tokens = metrics.pop(MICRO_TOKENS_KEY, [])
        self._step_view["micro_tokens"] = micro_tokens
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
        return metrics

    def report_monitor(self, step: int) -> None:
        """The tuning guide's monitor lines and plots (trainer.enable_monitor), at step 1 and every interval."""
        view = self._step_view
        if self.visualizer is None or not view:
            return
        micro = view.get("micro_tokens", [])
        self.visualizer.record(step, micro, view["lengths"], view["raw"], view["balanced"])
        if should_report(step, self.cfg.trainer.monitor_interval):
            samples = [len(view["lengths"]) // view["dp"]] * view["dp"]
            for line in monitor_lines(micro) + [balancer_line(samples, view["balanced"])]:
                self.tracker.console(line)
            images = self.visualizer.maybe_plot(step)
            if images:
                self.tracker.log_images({f"dynamic_batch/{k}": v for k, v in images.items()}, step)

    def validate(self) -> Dict[str, float]:
        """Greedy generation on the whole validation set; mean score per data_source."""
        val = self.data.val
        outputs = []
        for i, chunk in enumerate(val.split(self.data.val_batch_size or len(val))):
            chunk.meta.update(validate=True, rollout_call_index=VALIDATION_CALL_OFFSET + self.global_step * 1024 + i)
            outputs.append(self.workers.actor_rollout.generate_sequences(chunk))
        out = Batch.concat(outputs) if len(outputs) > 1 else outputs[0]
        scores, _ = self.reward(out)
        per_sample = scores.sum(-1).numpy()
        sources = np.asarray(out["data_source"]).astype(str)
        metrics = {f"val/score/{src}": float(per_sample[sources == src].mean()) for src in np.unique(sources)}
        metrics["val/score/mean"] = float(per_sample.mean())
        metrics["val/response_length/mean"] = float(out["response_mask"].sum(-1).float().mean())
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> str:
        def save_workers(path: str) -> None:
            self.workers.actor_rollout.save_checkpoint(path)
            # A complete Hugging Face directory of the actor, loadable without Ballast (or by vLLM).
            self.workers.actor_rollout.export_hf(os.path.join(path, "actor_hf"))
            if self.workers.critic is not None:
                self.workers.critic.save_checkpoint(path)

        state = {"dataloader": self.data.state_dict(), "kl_coef": self.kl_ctrl.value, "rng": rng_state(),
                 "nonfinite_in_a_row": self._nonfinite_in_a_row}
        return self.ckpt.save(self.global_step, save_workers, state)

    def resume(self) -> Optional[str]:
        """Load the checkpoint `trainer.resume_mode` points at (once); returns its path or None."""
        if self._resume_checked:
            return self._resumed_from
        self._resume_checked = True
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            return None
        if t.resume_mode == "auto":
            path = self.ckpt.latest()
        elif t.resume_mode == "resume_path":
            path = t.resume_from_path
        else:
            path = t.resume_mode
        if path is None:
            return None
        state = CheckpointManager.read_state(path)
        self.workers.actor_rollout.load_checkpoint(path)
        if self.workers.critic is not None:
            self.workers.critic.load_checkpoint(path)
        self.global_step = int(state["global_step"])
        self.data.load_state_dict(state["dataloader"])
        self.kl_ctrl.value = float(state["kl_coef"])
        self._nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        set_rng_state(state["rng"])
        print(f"ballast: resumed from {path} at step {self.global_step}")
        self._resumed_from = path
        return path


@contextlib.contextmanager
def _timer(timing: Dict[str, float], name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = time.perf_counter() - start
