"""Write the synthetic "repeat a symbol K times" task as verl-format parquet (train.parquet, val.parquet).

    python examples/data/make_synthetic.py --out data/repeat --train-size 1024 --val-size 128 --seed 0

Prints where the files went and the ideal-response length statistics (long-tailed by design).
The task and its reward are described in ballast/data/synthetic.py.
"""

from __future__ import annotations

import argparse
import json

from ballast.data.io import read_rows
from ballast.data.synthetic import DEFAULT_SYMBOLS, length_stats, write_repeat_dataset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train-size", type=int, default=1024)
    parser.add_argument("--val-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--symbols", default=DEFAULT_SYMBOLS, help="characters to repeat (each one token)")
    parser.add_argument("--k-median", type=float, default=16.0, help="median target count K")
    parser.add_argument("--k-sigma", type=float, default=1.0, help="log-std of K (larger = longer tail)")
    parser.add_argument("--k-min", type=int, default=1)
    parser.add_argument("--k-max", type=int, default=192, help="keep below max_response_length - 1")
    args = parser.parse_args(argv)
    paths = write_repeat_dataset(
        args.out,
        train_size=args.train_size,
        val_size=args.val_size,
        seed=args.seed,
        symbols=args.symbols,
        k_median=args.k_median,
        k_sigma=args.k_sigma,
        k_min=args.k_min,
        k_max=args.k_max,
    )
    for split, path in paths.items():
        rows = read_rows(path)
        stats = length_stats(rows) if rows else {}
        print(json.dumps({"split": split, "path": str(path), "rows": len(rows), "response_chars": stats}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
