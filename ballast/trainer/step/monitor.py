"""Dynamic-batch monitoring: the tuning guide's log lines, their metrics, and `DynamicBatchVisualizer`.

With `trainer.enable_monitor=True`, at step 1 and every `trainer.monitor_interval` steps the driver
logs one line per DP rank about its micro-batches in the actor update,

    DynamicBatchMonitor: dp_rank_0 - avg_tokens=15822, max_tokens=16371, min_tokens=12403, batch_count=24

(real tokens per micro-batch; batch_count = micro-batches the rank ran this step), and one line about
the balanced split,

    DeviceMeshBalancer: dp_rank_0 assigned 24 samples (61234 tokens), dp_rank_1 assigned 24 samples ...

The same numbers go to the metrics every step (`perf/micro_batch_tokens/{avg,max,min}`,
`perf/num_micro_batches`, `balance/rank_{r}/tokens`). The visualizer turns recorded steps into PNGs;
`BalanceMonitor` owns what all of this needs from a step and decides when it is drawn.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np


def micro_batch_metrics(tokens_per_rank: Sequence[Sequence[int]]) -> Dict[str, float]:
    """Metrics over every real micro-batch of every rank (one actor update)."""
    flat = [t for rank in tokens_per_rank for t in rank]
    if not flat:
        return {}
    return {
        "perf/micro_batch_tokens/avg": float(np.mean(flat)),
        "perf/micro_batch_tokens/max": float(np.max(flat)),
        "perf/micro_batch_tokens/min": float(np.min(flat)),
        "perf/max_micro_batch_tokens": float(np.max(flat)),
        "perf/num_micro_batches_per_rank/max": float(max(len(r) for r in tokens_per_rank)),
    }


def monitor_lines(tokens_per_rank: Sequence[Sequence[int]]) -> List[str]:
    lines = []
    for rank, tokens in enumerate(tokens_per_rank):
        if tokens:
            lines.append(f"DynamicBatchMonitor: dp_rank_{rank} - avg_tokens={int(round(np.mean(tokens)))}, "
                         f"max_tokens={int(np.max(tokens))}, min_tokens={int(np.min(tokens))}, "
                         f"batch_count={len(tokens)}")
        else:
            lines.append(f"DynamicBatchMonitor: dp_rank_{rank} - no micro-batches")
    return lines


def balancer_line(samples_per_rank: Sequence[int], tokens_per_rank: Sequence[int]) -> str:
    parts = [f"dp_rank_{r} assigned {int(s)} samples ({int(t)} tokens)"
             for r, (s, t) in enumerate(zip(samples_per_rank, tokens_per_rank))]
    return "DeviceMeshBalancer: " + ", ".join(parts)


def rank_load_metrics(raw: Sequence[int], balanced: Sequence[int]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for rank, (r, b) in enumerate(zip(raw, balanced)):
        out[f"balance/rank_{rank}/raw_tokens"] = float(r)
        out[f"balance/rank_{rank}/tokens"] = float(b)
    return out


def should_report(step: int, interval: int) -> bool:
    return step == 1 or (interval > 0 and step % interval == 0)


@dataclass
class _StepRecord:
    step: int
    micro_tokens_per_rank: List[List[int]]
    sample_lengths: np.ndarray
    raw_rank_tokens: np.ndarray
    balanced_rank_tokens: np.ndarray


@dataclass
class DynamicBatchVisualizer:
    """Records steps and draws, every `plot_interval` steps (and at step 1), three headless PNGs:

    * `micro_batch_tokens_step_<k>.png`: per-rank histogram of micro-batch tokens with the budget line;
    * `sample_lengths_step_<k>.png`: sample length vs number of samples (the long tail on a log axis);
    * `rank_load.png`: per-rank tokens before vs after balance, over all recorded steps.
    """

    save_dir: str
    plot_interval: int = 500
    token_budget: Optional[int] = None
    records: List[_StepRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.plot_interval < 1:
            raise ValueError(f"DynamicBatchVisualizer.plot_interval={self.plot_interval} must be >= 1")
        os.makedirs(self.save_dir, exist_ok=True)

    def record(self, step: int, micro_tokens_per_rank: Sequence[Sequence[int]], sample_lengths: Sequence[int],
               raw_rank_tokens: Sequence[int], balanced_rank_tokens: Sequence[int]) -> None:
        self.records.append(_StepRecord(step, [list(map(int, r)) for r in micro_tokens_per_rank],
                                        np.asarray(sample_lengths, dtype=np.int64),
                                        np.asarray(raw_rank_tokens), np.asarray(balanced_rank_tokens)))

    def maybe_plot(self, step: int) -> Dict[str, str]:
        """Draw the plots if `step` is a plotting step; returns {name: png path} (empty otherwise)."""
        if not self.records or not should_report(step, self.plot_interval):
            return {}
        return self.plot()

    def plot(self) -> Dict[str, str]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        last = self.records[-1]
        paths = {}
        ranks = len(last.micro_tokens_per_rank)
        fig, axes = plt.subplots(1, max(ranks, 1), figsize=(3.2 * max(ranks, 1), 3), dpi=100, squeeze=False)
        for rank, ax in enumerate(axes[0]):
            tokens = last.micro_tokens_per_rank[rank] if rank < ranks else []
            ax.hist(tokens, bins=min(20, max(len(tokens), 1)), color="tab:blue")
            if self.token_budget:
                ax.axvline(self.token_budget, color="tab:red", linestyle="--", label="budget")
                ax.legend(fontsize=7)
            ax.set_title(f"dp_rank_{rank} ({len(tokens)} micro-batches)", fontsize=9)
            ax.set_xlabel("tokens per micro-batch", fontsize=8)
        fig.suptitle(f"Micro-batch tokens, step {last.step}", fontsize=10)
        fig.tight_layout()
        paths["micro_batch_tokens"] = self._save(fig, f"micro_batch_tokens_step_{last.step}.png")

        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        values, counts = np.unique(last.sample_lengths, return_counts=True)
        ax.scatter(values, counts, s=10)
        ax.set_xscale("log")
        ax.set_xlabel("sample length (tokens)")
        ax.set_ylabel("number of samples")
        ax.set_title(f"Sample lengths, step {last.step}")
        fig.tight_layout()
        paths["sample_lengths"] = self._save(fig, f"sample_lengths_step_{last.step}.png")

        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
        steps = [r.step for r in self.records]
        raw = np.stack([r.raw_rank_tokens for r in self.records])
        bal = np.stack([r.balanced_rank_tokens for r in self.records])
        for rank in range(raw.shape[1]):
            line, = ax.plot(steps, raw[:, rank], linestyle=":", marker=".")
            ax.plot(steps, bal[:, rank], color=line.get_color(), marker="o", label=f"dp_rank_{rank}")
        ax.set_xlabel("step")
        ax.set_ylabel("tokens per rank")
        ax.set_title("Per-rank load: dotted before balance, solid after")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths["rank_load"] = self._save(fig, "rank_load.png")
        return paths

    def _save(self, fig, name: str) -> str:
        import matplotlib.pyplot as plt

        path = os.path.join(self.save_dir, name)
        fig.savefig(path)
        plt.close(fig)
        return path


class BalanceMonitor:
    """What the balance chart and the dynamic-batch monitor need from one training step, and when
    they are drawn, in one place.

    Within a step the trainer calls `record_balance` (after planning the DP split), then
    `record_micro_tokens` (after the actor update, if there is one), then `report(step)` once at the
    end. `report` draws the per-rank balance chart (`charts/balance_step_<k>.png`) at step 1, every
    `CHART_EVERY` steps and at the last step and, with `trainer.enable_monitor`, logs the monitor
    lines and plots at step 1 and every `monitor_interval` steps. Each step starts from nothing.
    """

    CHART_EVERY = 10

    def __init__(self, tracker, total_steps: int, enable_monitor: bool, monitor_interval: int,
                 token_budget: Optional[int]) -> None:
        self.tracker, self.total_steps, self.monitor_interval = tracker, total_steps, monitor_interval
        self.visualizer = None
        if enable_monitor:
            self.visualizer = DynamicBatchVisualizer(os.path.join(tracker.run_dir, "dynamic_batch_plots"),
                                                     plot_interval=monitor_interval, token_budget=token_budget)
        self._step: Dict[str, object] = {}

    def record_balance(self, lengths: np.ndarray, raw: Sequence[int], balanced: Sequence[int], dp: int) -> None:
        self._step = {"lengths": lengths, "raw": raw, "balanced": balanced, "dp": dp, "micro_tokens": []}

    def record_micro_tokens(self, tokens_per_rank: Sequence[Sequence[int]]) -> None:
        if self._step:
            self._step["micro_tokens"] = tokens_per_rank

    def report(self, step: int) -> None:
        view, self._step = self._step, {}
        if not view:
            return
        if step == 1 or step % self.CHART_EVERY == 0 or step == self.total_steps:
            from ballast.trainer.step.charts import save_balance_chart

            path = os.path.join(self.tracker.run_dir, "charts", f"balance_step_{step}.png")
            chart = save_balance_chart(path, view["raw"], view["balanced"], step)
            self.tracker.log_images({"balance/per_rank_tokens": chart}, step)
        if self.visualizer is None:
            return
        micro = view["micro_tokens"]
        self.visualizer.record(step, micro, view["lengths"], view["raw"], view["balanced"])
        if should_report(step, self.monitor_interval):
            samples = [len(view["lengths"]) // view["dp"]] * view["dp"]
            for line in monitor_lines(micro) + [balancer_line(samples, view["balanced"])]:
                self.tracker.console(line)
            images = self.visualizer.maybe_plot(step)
            if images:
                self.tracker.log_images({f"dynamic_batch/{k}": v for k, v in images.items()}, step)
