"""A small coding task built offline: "Write a Python function `f(x)` that ...", scored by hidden tests.

Each row asks for one short function (add or multiply by a constant, square, reverse or upper-case a
string, count a character, sum/max/length of a list, parity, absolute value, ...). Its
`reward_model.ground_truth` is verl's test-case JSON with `fn_name` and five hidden calls
(`ballast.data.code_reward`), and its data_source is "ballast/code", so the sandboxed code reward
scores it (pass rate over the hidden tests by default). Prompts are chat messages: a system message
asking for one ```python block, then the request. The held-out split uses constants and characters
the train split never asks for, so its pass rate measures more than recall of seen prompts.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

from ballast.data.io import write_parquet

DATA_SOURCE = "ballast/code"
ABILITY = "code"
SYSTEM = ("You are a Python programmer. Answer with one ```python code block that defines the requested "
          "function, and nothing else.")
NUM_TESTS = 5


def _families(rng, split: str):
    """(description, reference function, argument generator) per task family; constants depend on the split."""
    constants = list(range(2, 10)) if split == "train" else list(range(11, 16))
    letters = list("aeiost") if split == "train" else list("nrl")
    k = int(rng.choice(constants))
    c = str(rng.choice(letters))
    ints = lambda: int(rng.integers(-50, 51))  # noqa: E731
    word = lambda: "".join(rng.choice(list("abcdeilnorst"), size=int(rng.integers(1, 9))))  # noqa: E731
    int_list = lambda: [int(v) for v in rng.integers(-20, 21, size=int(rng.integers(1, 7)))]  # noqa: E731
    return [
        (f"returns x plus {k}", lambda x: x + k, ints),
        (f"returns x multiplied by {k}", lambda x: x * k, ints),
        ("returns the square of x", lambda x: x * x, ints),
        ("returns the absolute value of x", abs, ints),
        ("returns True if the integer x is even and False otherwise", lambda x: x % 2 == 0, ints),
        ("returns the string x reversed", lambda x: x[::-1], word),
        ("returns the string x in upper case", lambda x: x.upper(), word),
        (f"returns how many times the letter '{c}' occurs in the string x", lambda x: x.count(c), word),
        ("returns the sum of the list of integers x", sum, int_list),
        ("returns the largest element of the list of integers x", max, int_list),
        ("returns the number of elements in the list x", len, int_list),
        (f"returns the list x with every element multiplied by {k}", lambda x: [v * k for v in x], int_list),
    ]


def make_coding_rows(num_rows: int, *, seed: int = 0, split: str = "train") -> list[dict]:
    """`num_rows` task rows in verl's format (module docstring)."""
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    rng = np.random.default_rng([seed, zlib.crc32(split.encode())])
    rows = []
    for index in range(num_rows):
        families = _families(rng, split)
        description, fn, draw = families[int(rng.integers(len(families)))]
        args = [draw() for _ in range(NUM_TESTS)]
        truth = {"fn_name": "f", "inputs": [json.dumps(a) for a in args], "outputs": [json.dumps(fn(a)) for a in args]}
        request = f"Write a Python function `f(x)` that {description}."
        rows.append({
            "data_source": DATA_SOURCE, "ability": ABILITY,
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": request}],
            "reward_model": {"style": "rule", "ground_truth": json.dumps(truth)},
            "extra_info": {"split": split, "index": index, "task": description},
        })
    return rows


def write_coding_dataset(out_dir: str | os.PathLike, *, train_size: int = 512, val_size: int = 32,
                         seed: int = 0) -> dict[str, Path]:
    """``train.parquet`` and a held-out ``val.parquet`` (no request of the train split) under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = make_coding_rows(train_size, seed=seed, split="train")
    seen = {row["prompt"][-1]["content"] for row in train}
    val, requests = [], set()
    for row in make_coding_rows(8 * val_size + 64, seed=seed, split="val"):
        request = row["prompt"][-1]["content"]
        if request not in seen and request not in requests:  # distinct held-out requests
            requests.add(request)
            val.append(row)
    if len(val) < val_size:
        val = [r for r in make_coding_rows(8 * val_size + 64, seed=seed, split="val")
               if r["prompt"][-1]["content"] not in seen][:val_size]
    val = val[:val_size]
    for index, row in enumerate(val):
        row["extra_info"]["index"] = index
    return {"train": write_parquet(train, out / "train.parquet"), "val": write_parquet(val, out / "val.parquet")}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write the offline coding task (train/val parquet).")
    parser.add_argument("out_dir")
    parser.add_argument("--train-size", type=int, default=512)
    parser.add_argument("--val-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    print(write_coding_dataset(a.out_dir, train_size=a.train_size, val_size=a.val_size, seed=a.seed))
