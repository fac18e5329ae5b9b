"""Command-line values that hydra reads differently from what a verl user means by them.

verl's rollout-correction thresholds take "lower_upper" pairs such as `0.5_5.0`. Hydra's override
grammar, like Python, allows `_` between digits in numbers, so `0.2_9` or `1_2` arrive as the numbers
0.29 and 12: a silently different threshold. Such a value must be quoted (`'0.2_9'`) or written with
a decimal point in both bounds (`0.2_9.0`, not a number), and an unquoted one is refused here.
"""

from __future__ import annotations

from typing import Iterable, List

# Keys whose values are "lower_upper" pairs (or comma-separated lists of them).
PAIR_KEYS = ("algorithm.rollout_correction.rollout_is_threshold",
             "algorithm.rollout_correction.rollout_rs_threshold")


def ambiguous_overrides(overrides: Iterable[str]) -> List[str]:
    """A message for every override of a `PAIR_KEYS` key whose unquoted value hydra would read as a number."""
    messages = []
    for override in overrides:
        key, sep, value = str(override).partition("=")
        key, value = key.lstrip("+~"), value.strip()
        if not sep or key not in PAIR_KEYS or "_" not in value or value[:1] in ("'", '"'):
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        messages.append(f"{key}={value} would be read as the number {number:g} ('_' separates digits in numbers): "
                        f"quote it ({key}='{value}') or give both bounds a decimal point (e.g. 0.5_5.0)")
    return messages
