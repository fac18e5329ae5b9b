"""Monitor lines in the tuning guide's format, their metrics, and the visualizer's PNGs."""

import re

import numpy as np
import pytest

from ballast.trainer.step.monitor import (
    BalanceMonitor, DynamicBatchVisualizer, balancer_line, micro_batch_metrics, monitor_lines, should_report,
)

LINE = re.compile(r"^DynamicBatchMonitor: dp_rank_(\d+) - avg_tokens=(\d+), max_tokens=(\d+), "
                  r"min_tokens=(\d+), batch_count=(\d+)$")


def test_monitor_lines_follow_the_article_format():
    lines = monitor_lines([[16371, 12403, 18692], [900]])
    m = LINE.match(lines[0])
    assert m and m.groups() == ("0", "15822", "18692", "12403", "3")
    assert LINE.match(lines[1]).groups() == ("1", "900", "900", "900", "1")
    assert balancer_line([24, 25], [1000, 990]) == (
        "DeviceMeshBalancer: dp_rank_0 assigned 24 samples (1000 tokens), dp_rank_1 assigned 25 samples (990 tokens)")


def test_micro_batch_metrics_and_schedule():
    metrics = micro_batch_metrics([[10, 30], [20]])
    assert metrics["perf/micro_batch_tokens/avg"] == 20 and metrics["perf/max_micro_batch_tokens"] == 30
    assert metrics["perf/micro_batch_tokens/min"] == 10
    assert [s for s in range(1, 11) if should_report(s, 4)] == [1, 4, 8]


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_visualizer_renders_valid_pngs_from_a_recorded_run(tmp_path):
    rng = np.random.default_rng(0)
    viz = DynamicBatchVisualizer(str(tmp_path), plot_interval=2, token_budget=1024)
    for step in (1, 2, 3, 4):
        lengths = np.minimum(1023, rng.lognormal(4.5, 0.9, 64).astype(int) + 8)
        viz.record(step, [[900, 850, 400], [1000, 700, 650]], lengths, [5000 + step, 3000], [4100, 3900 + step])
    assert viz.maybe_plot(3) == {}
    paths = viz.maybe_plot(4)
    assert set(paths) == {"micro_batch_tokens", "sample_lengths", "rank_load"}
    assert _png_size(paths["micro_batch_tokens"]) == (640, 300)  # 2 ranks x 3.2 in x 100 dpi, 3 in tall
    assert _png_size(paths["sample_lengths"]) == (500, 320)
    assert _png_size(paths["rank_load"]) == (600, 320)
    with pytest.raises(ValueError, match="plot_interval=0"):
        DynamicBatchVisualizer(str(tmp_path), plot_interval=0)


class _Tracker:
    def __init__(self, run_dir):
        self.run_dir, self.lines, self.images = str(run_dir), [], []

    def console(self, line):
        self.lines.append(line)

    def log_images(self, images, step):
        self.images.append((step, sorted(images)))


def test_balance_monitor_owns_its_schedule_and_forgets_each_step(tmp_path):
    tracker = _Tracker(tmp_path)
    monitor = BalanceMonitor(tracker, total_steps=12, enable_monitor=True, monitor_interval=5, token_budget=64)
    for step in range(1, 13):
        monitor.record_balance(np.array([10, 20, 30, 40]), np.array([30, 70]), np.array([50, 50]), dp=2)
        monitor.record_micro_tokens([[30, 20], [50]])
        monitor.report(step)
    chart_steps = [s for s, names in tracker.images if names == ["balance/per_rank_tokens"]]
    assert chart_steps == [1, 10, 12]
    assert (tmp_path / "charts" / "balance_step_12.png").is_file()
    monitor_steps = [s for s, names in tracker.images if "dynamic_batch/rank_load" in names]
    assert monitor_steps == [1, 5, 10]
    assert len([line for line in tracker.lines if line.startswith("DynamicBatchMonitor")]) == 3 * 2
    assert "DeviceMeshBalancer: dp_rank_0 assigned 2 samples (50 tokens)" in tracker.lines[2]
    assert [r.micro_tokens_per_rank for r in monitor.visualizer.records][-1] == [[30, 20], [50]]
    before = list(tracker.images)
    monitor.report(10)  # nothing recorded since the last report: nothing to draw or print
    assert tracker.images == before
