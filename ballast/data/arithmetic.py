"""Short arithmetic questions with exact integer answers, for RL on a small pretrained chat model.

Why this task: SmolLM2-135M-Instruct (the real model Ballast converts offline) follows chat formats
but is weak at arithmetic, so its starting greedy accuracy is low but not zero, and every answer can
be checked exactly. Everything is generated offline and deterministically from (seed, split).

* Prompt: one user message, e.g. ``What is 47 + 38? Give only the final number.``
* Kinds: ``add`` (a + b), ``sub`` (a - b, never negative) and ``mul`` (a * b), with a in [lo, hi]
  and b in [b_lo, b_hi] (default: the same range as a), and ``add3`` (three one-digit operands); a
  mixture is drawn uniformly per row.
* Ground truth: the integer answer as a string.
* Reward (`arithmetic_score`, data_source ``"ballast/arithmetic"``): 1.0 when the LAST integer in
  the response equals the answer, else 0.0; also reports ``answered`` (an integer was found).

Rows follow verl: ``data_source``, ``prompt`` (chat messages), ``ability``, ``reward_model``
(``{"style": "rule", "ground_truth": str}``) and ``extra_info`` (``split``, ``index``, ``kind``,
``operands``).
"""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path

import numpy as np

from ballast.data.io import write_parquet

DATA_SOURCE = "ballast/arithmetic"
ABILITY = "arithmetic"
KINDS = ("add", "sub", "mul", "add3")
INSTRUCTION = "Give only the final number."
_INTEGER = re.compile(r"-?\d+")


def _question(kind: str, rng: np.random.Generator, lo: int, hi: int, b_lo: int, b_hi: int) -> tuple[str, list[int], int]:
    if kind in ("add", "sub", "mul"):
        a, b = int(rng.integers(lo, hi + 1)), int(rng.integers(b_lo, b_hi + 1))
        if kind == "add":
            return f"What is {a} + {b}?", [a, b], a + b
        if kind == "mul":
            return f"What is {a} * {b}?", [a, b], a * b
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", [a, b], a - b
    if kind == "add3":
        a, b, c = (int(x) for x in rng.integers(1, 10, size=3))
        return f"What is {a} + {b} + {c}?", [a, b, c], a + b + c
    raise ValueError(f"unknown arithmetic kind {kind!r}; choose from {KINDS}")


def make_arithmetic_rows(
    num_rows: int,
    *,
    seed: int = 0,
    split: str = "train",
    kinds: tuple[str, ...] | list[str] = ("add",),
    lo: int = 10,
    hi: int = 99,
    b_lo: int | None = None,
    b_hi: int | None = None,
) -> list[dict]:
    """`num_rows` task rows in verl's format; deterministic for (seed, split and the task settings)."""
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {list(kinds)}")
    b_lo, b_hi = lo if b_lo is None else b_lo, hi if b_hi is None else b_hi
    if not (0 <= lo <= hi and 0 <= b_lo <= b_hi):
        raise ValueError(f"need 0 <= lo <= hi and 0 <= b_lo <= b_hi, got lo={lo}, hi={hi}, b_lo={b_lo}, b_hi={b_hi}")
    # The split name enters the seed so train and val never share a random stream.
    rng = np.random.default_rng([seed, zlib.crc32(split.encode())])
    rows = []
    for index in range(num_rows):
        kind = kinds[int(rng.integers(len(kinds)))]
        question, operands, answer = _question(kind, rng, lo, hi, b_lo, b_hi)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": ABILITY,
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": index, "kind": kind, "operands": operands},
            }
        )
    return rows


def write_arithmetic_dataset(
    out_dir: str | os.PathLike,
    *,
    train_size: int = 4096,
    val_size: int = 128,
    seed: int = 0,
    **task_kwargs,
) -> dict[str, Path]:
    """Write ``train.parquet`` and ``val.parquet`` under `out_dir`; returns {split: path}. The val
    split is held out: its questions are filtered to ones not in the train split."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = make_arithmetic_rows(train_size, seed=seed, split="train", **task_kwargs)
    seen = {row["prompt"][0]["content"] for row in train}
    val = [r for r in make_arithmetic_rows(2 * val_size + 64, seed=seed, split="val", **task_kwargs)
           if r["prompt"][0]["content"] not in seen][:val_size]
    if len(val) < val_size:
        raise ValueError(f"only {len(val)} held-out questions differ from the train split; widen lo/hi")
    for index, row in enumerate(val):
        row["extra_info"]["index"] = index
    return {"train": write_parquet(train, out / "train.parquet"), "val": write_parquet(val, out / "val.parquet")}


def last_integer(text: str) -> int | None:
    """The last integer written in `text` (thousands separators removed), or None."""
    found = _INTEGER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def arithmetic_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """1.0 if the last integer of the response equals `ground_truth`, else 0.0 (see module doc)."""
    try:
        expected = int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(f"arithmetic ground_truth must be an integer, got {ground_truth!r}") from None
    answer = last_integer(solution_str)
    return {"score": float(answer == expected), "answered": float(answer is not None)}
