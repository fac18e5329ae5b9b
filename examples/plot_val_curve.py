"""Draw held-out greedy score against training step from one or more runs' metrics.jsonl files.

    python examples/plot_val_curve.py --out docs/smollm2_arithmetic_curve.png \
        outputs/smollm2_arith_seed1/metrics.jsonl outputs/smollm2_arith_seed2/metrics.jsonl

Each file is one run (one seed); its line is labelled with the file's parent directory. Also prints,
per run, the score at the first and last validation, the gain, the best score, and the training wall
time to the last validation (sum of timing_s/step, so validation time is excluded) as JSON lines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEY = "val/score/mean"


def load_run(path: str | Path, key: str = KEY) -> dict:
    """Validation points (step, score) and the cumulative training time at each logged step."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    points, elapsed_s, wall_at = [], 0.0, {}
    for row in rows:
        elapsed_s += float(row.get("timing_s/step", 0.0))
        wall_at[int(row["step"])] = elapsed_s
        if key in row:
            points.append((int(row["step"]), float(row[key])))
    if not points:
        raise ValueError(f"{path}: no {key!r} entries (was validation enabled?)")
    return {"points": points, "wall_s": wall_at}


def summary(name: str, run: dict) -> dict:
    (first_step, first), (last_step, last) = run["points"][0], run["points"][-1]
    return {"run": name, "first_step": first_step, "first": first, "last_step": last_step, "last": last,
            "gain": last - first, "best": max(s for _, s in run["points"]),
            "train_wall_s_to_last_val": run["wall_s"].get(last_step, 0.0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files, one per run")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--key", default=KEY, help="metric to plot")
    parser.add_argument("--title", default="SmolLM2-135M-Instruct, GRPO on arithmetic (CPU, 2 workers)")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for path in args.metrics:
        run = load_run(path, args.key)
        name = Path(path).parent.name
        steps, scores = zip(*run["points"])
        ax.plot(steps, scores, marker="o", label=name)
        print(json.dumps(summary(name, run)))
    ax.set_xlabel("training step")
    ax.set_ylabel(f"held-out greedy score ({args.key})")
    ax.set_title(args.title, fontsize=10)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
