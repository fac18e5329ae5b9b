"""The built-in synthetic RL task, "repeat a symbol K times", written in verl's parquet format.

Why this task: a random-init tiny model must show learning by RL alone within a few dozen GRPO
steps, and the ideal responses must have long-tailed lengths so that balancing and dynamic batch
sizes have something to do.

* Prompt: ``Repeat the symbol # exactly 37 times.`` (one user message).
* Ground truth: the symbol repeated K times (``"#" * 37``). With Ballast's tiny tokenizer every
  symbol is one token and runs of symbols never merge, so the ideal response is K tokens + eos.
* K is drawn from a log-normal with median `k_median` and log-std `k_sigma`, rounded and clipped
  to ``[k_min, k_max]``: most answers are short, a few are 5-10x the median (max/median >= 4 with the
  defaults on any split of a few hundred rows).
* Reward (`ballast.data.rewards.repeat_score`, data_source ``"ballast/repeat"``): partial credit
  ``(w + (1 - w) * content) * closeness`` in [0, 1], where, on the response with surrounding
  whitespace stripped (length L characters), ``content`` is the fraction of characters equal to the
  symbol and ``closeness = min(L, K) / max(L, K)``; w = 0.2. Only the exact answer scores 1. The
  closeness term is what makes the signal dense from step one: a random policy stops at random
  lengths, so scores spread within every GRPO group, and the first thing to learn is when to stop;
  content credit then grows once lengths are in range.

Rows follow verl: ``data_source``, ``prompt`` (chat messages), ``ability``, ``reward_model``
(``{"style": "rule", "ground_truth": str}``) and ``extra_info`` (``split``, ``index``, ``symbol``,
``count``).
"""

from __future__ import annotations

import math
import os
import zlib
from pathlib import Path

import numpy as np

from ballast.data.io import write_parquet

DATA_SOURCE = "ballast/repeat"
ABILITY = "repeat"
# Every symbol is a single token in the tiny tokenizer (tests check it against
# ballast.models.corpus.TASK_SYMBOLS). Four keeps the "which symbol" part learnable quickly.
DEFAULT_SYMBOLS = "#*@%"
PROMPT_TEMPLATE = "Repeat the symbol {symbol} exactly {count} times."


def sample_counts(
    num_rows: int,
    rng: np.random.Generator,
    *,
    k_median: float = 16.0,
    k_sigma: float = 1.0,
    k_min: int = 1,
    k_max: int = 192,
) -> np.ndarray:
    """Target counts K ~ round(LogNormal(log(k_median), k_sigma)) clipped to [k_min, k_max]."""
    if not 1 <= k_min <= k_max:
        raise ValueError(f"need 1 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
    if not (k_median > 0 and k_sigma >= 0):
        raise ValueError(f"need k_median > 0 and k_sigma >= 0, got k_median={k_median}, k_sigma={k_sigma}")
    raw = rng.lognormal(mean=math.log(k_median), sigma=k_sigma, size=num_rows)
    return np.clip(np.rint(raw), k_min, k_max).astype(np.int64)


def make_repeat_rows(
    num_rows: int,
    *,
    seed: int = 0,
    split: str = "train",
    symbols: str = DEFAULT_SYMBOLS,
    k_median: float = 16.0,
    k_sigma: float = 1.0,
    k_min: int = 1,
    k_max: int = 192,
) -> list[dict]:
    """`num_rows` task rows in verl's format; deterministic for (seed, split)."""
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    if not symbols or any(len(s) != 1 or s.isspace() or s.isalnum() for s in symbols):
        raise ValueError(f"symbols must be non-alphanumeric, non-space single characters, got {symbols!r}")
    # The split name enters the seed so train and val never share a random stream.
    rng = np.random.default_rng([seed, zlib.crc32(split.encode())])
    counts = sample_counts(num_rows, rng, k_median=k_median, k_sigma=k_sigma, k_min=k_min, k_max=k_max)
    picks = rng.integers(0, len(symbols), size=num_rows)
    rows = []
    for index, (count, pick) in enumerate(zip(counts.tolist(), picks.tolist())):
        symbol = symbols[pick]
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(symbol=symbol, count=count)}],
                "ability": ABILITY,
                "reward_model": {"style": "rule", "ground_truth": symbol * count},
                "extra_info": {"split": split, "index": index, "symbol": symbol, "count": count},
            }
        )
    return rows


def write_repeat_dataset(
    out_dir: str | os.PathLike,
    *,
    train_size: int = 1024,
    val_size: int = 128,
    seed: int = 0,
    **task_kwargs,
) -> dict[str, Path]:
    """Write ``train.parquet`` and ``val.parquet`` under `out_dir`; returns {split: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, size in (("train", train_size), ("val", val_size)):
        rows = make_repeat_rows(size, seed=seed, split=split, **task_kwargs)
        paths[split] = write_parquet(rows, out / f"{split}.parquet")
    return paths


def length_stats(rows: list[dict]) -> dict[str, float]:
    """Summary of the ideal response lengths (characters = tokens for the tiny tokenizer)."""
    lengths = np.array([len(r["reward_model"]["ground_truth"]) for r in rows], dtype=np.float64)
    if lengths.size == 0:
        raise ValueError("no rows")
    median = float(np.median(lengths))
    return {
        "min": float(lengths.min()),
        "median": median,
        "mean": float(lengths.mean()),
        "p90": float(np.percentile(lengths, 90)),
        "max": float(lengths.max()),
        "max_over_median": float(lengths.max() / median),
    }
