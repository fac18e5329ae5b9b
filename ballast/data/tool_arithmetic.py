"""Multi-digit products that a small model cannot do in its head but can with a calculator tool.

The task for agent-loop RL (`tool_agent` with the `calculator` tool): "What is 347 * 86?".
SmolLM2-135M-Instruct gets essentially none of these right unaided, so any reward comes from calling
the tool and copying its result into the answer.

* Prompt (chat messages): a system message describing the calculator and the answer format, then
  (`one_shot=True`, the default) one worked example (user question, assistant tool call, tool
  result, assistant answer), then the question. The example is what lets a 135M model produce a
  well-formed `hermes` tool call at all (its chat template has no tool support).
* Rows carry `agent_name: tool_agent`, so they run the tool loop whatever the default loop is.
* Reward (`tool_arithmetic_score`, data_source ``"ballast/tool_arithmetic"``): 1.0 when the LAST
  ``Answer: <integer>`` in the response equals the product, else 0.0. Only the model writes
  "Answer:"; the calculator's reply is a bare number, so a conversation that ends on a tool result
  scores nothing. Also reported: ``answered`` (an "Answer:" was found) and ``called_tool``.
"""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path

import numpy as np

from ballast.data.io import write_parquet

DATA_SOURCE = "ballast/tool_arithmetic"
ABILITY = "tool_arithmetic"
SYSTEM = ("You are a helpful assistant with a calculator tool. To use it, write exactly:\n"
          '<tool_call>{"name": "calculator", "arguments": {"expression": "<expression>"}}</tool_call>\n'
          "The tool result comes back in the next message. Then give the final answer as: Answer: <number>")
_EXAMPLE = [
    {"role": "user", "content": "What is 23 * 41?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "23 * 41"}}'
                                     '</tool_call>'},
    {"role": "tool", "content": "943"},
    {"role": "assistant", "content": "Answer: 943"},
]
_ANSWER = re.compile(r"Answer:\s*(-?[\d,]+)")


def make_tool_arithmetic_rows(num_rows: int, *, seed: int = 0, split: str = "train", a_digits=(3, 3),
                              b_digits=(2, 3), one_shot: bool = True) -> list[dict]:
    """`num_rows` rows "What is a * b?" with a of `a_digits` and b of `b_digits` digits (inclusive ranges)."""
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    rng = np.random.default_rng([seed, zlib.crc32(split.encode())])

    def draw(digits):
        n = int(rng.integers(digits[0], digits[1] + 1))
        return int(rng.integers(10 ** (n - 1), 10 ** n))

    rows = []
    for index in range(num_rows):
        a, b = draw(a_digits), draw(b_digits)
        question = f"What is {a} * {b}?"
        messages = [{"role": "system", "content": SYSTEM}, *(_EXAMPLE if one_shot else []),
                    {"role": "user", "content": question}]
        rows.append({
            "data_source": DATA_SOURCE, "prompt": messages, "ability": ABILITY, "agent_name": "tool_agent",
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": index, "operands": [a, b]},
        })
    return rows


def write_tool_arithmetic_dataset(out_dir: str | os.PathLike, *, train_size: int = 1024, val_size: int = 64,
                                  seed: int = 0, **task_kwargs) -> dict[str, Path]:
    """``train.parquet`` and a held-out ``val.parquet`` (no question of the train split) under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = make_tool_arithmetic_rows(train_size, seed=seed, split="train", **task_kwargs)
    seen = {row["prompt"][-1]["content"] for row in train}
    val = [r for r in make_tool_arithmetic_rows(2 * val_size + 64, seed=seed, split="val", **task_kwargs)
           if r["prompt"][-1]["content"] not in seen][:val_size]
    if len(val) < val_size:
        raise ValueError(f"only {len(val)} held-out questions differ from the train split")
    for index, row in enumerate(val):
        row["extra_info"]["index"] = index
    return {"train": write_parquet(train, out / "train.parquet"), "val": write_parquet(val, out / "val.parquet")}


def tool_arithmetic_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
                          ) -> dict:
    """1.0 if the last "Answer: <integer>" equals `ground_truth` (see the module docstring)."""
    try:
        expected = int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(f"tool_arithmetic ground_truth must be an integer, got {ground_truth!r}") from None
    found = _ANSWER.findall(solution_str)
    answer = None
    if found:
        try:
            answer = int(found[-1].replace(",", ""))
        except ValueError:
            answer = None
    return {"score": float(answer == expected), "answered": float(answer is not None),
            "called_tool": float("<tool_call>" in solution_str)}
