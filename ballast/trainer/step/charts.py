"""Per-rank token chart (raw contiguous split vs after balance_batch), as a PNG in the run directory."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np


def per_rank_tokens(lengths: np.ndarray, partitions: Sequence[np.ndarray], dp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw per-rank token sums of the contiguous split, balanced per-rank sums)."""
    raw = np.asarray(lengths).reshape(dp_size, -1).sum(axis=1)
    balanced = np.array([np.asarray(lengths)[p].sum() for p in partitions])
    return raw, balanced


def save_balance_chart(path: str, raw: np.ndarray, balanced: np.ndarray, step: int) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = np.arange(len(raw))
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    width = 0.4
    ax.bar(ranks - width / 2, raw, width, label=f"raw (max/mean {raw.max() / max(raw.mean(), 1e-9):.3f})")
    ax.bar(ranks + width / 2, balanced, width,
           label=f"balanced (max/mean {balanced.max() / max(balanced.mean(), 1e-9):.3f})")
    ax.axhline(raw.mean(), color="gray", linestyle="--", linewidth=1, label="mean")
    ax.set_xlabel("DP rank")
    ax.set_ylabel("tokens (prompt + response)")
    ax.set_title(f"Per-rank tokens at step {step}")
    ax.set_xticks(ranks)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
