"""Draw an agent-loop run's learning curves: held-out score, held-out tool use, training score.

    python examples/plot_agent_curve.py --out docs/smollm2_tool_curve.png \
        outputs/smollm2_tool_seed1/metrics.jsonl outputs/smollm2_tool_seed2/metrics.jsonl

One line per run (labelled with the file's parent directory) in three panels: `val/score/mean`
(held-out, validation sampling), `val/agent/tool_use_frac` (held-out samples with >= 1 tool call) and
`critic/score/mean` (the training batch's mean reward). Prints, per run, first and last value of each
as JSON lines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = (("val/score/mean", "held-out score"), ("val/agent/tool_use_frac", "held-out tool use"),
          ("critic/score/mean", "training score"))


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if key in r]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files, one per run")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--title", default="SmolLM2-135M-Instruct + calculator, GRPO on products (CPU, 2 workers)")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(12, 3.6))
    for path in args.metrics:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        # outputs/<run>/metrics.jsonl -> <run>; a copied <run>.metrics.jsonl -> <run>
        name = Path(path).parent.name if Path(path).name == "metrics.jsonl" else Path(path).name.split(".")[0]
        summary = {"run": name}
        for ax, (key, label) in zip(axes, PANELS):
            points = series(rows, key)
            if not points:
                continue
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o", markersize=3, label=name)
            ax.set_title(label, fontsize=10)
            summary[key] = {"first": (steps[0], values[0]), "last": (steps[-1], values[-1])}
        print(json.dumps(summary))
    for ax in axes:
        ax.set_xlabel("training step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
