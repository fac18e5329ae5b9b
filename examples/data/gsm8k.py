"""Convert a LOCAL GSM8K file (columns ``question``, ``answer``; parquet or JSONL) to verl's format.

    python examples/data/gsm8k.py --input /path/gsm8k/train.parquet --output data/gsm8k/train.parquet --split train
    python examples/data/gsm8k.py --input /path/gsm8k/test.jsonl --output data/gsm8k/test.parquet --split test

No download: get the files however your site allows. Rows are scored by the exact-answer reward
registered for data_source "openai/gsm8k" (ballast/data/rewards.py).
"""

from __future__ import annotations

import argparse

from ballast.data.gsm8k import convert_gsm8k_file
from ballast.data.io import read_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="local GSM8K .parquet or .jsonl")
    parser.add_argument("--output", required=True, help="output .parquet or .jsonl")
    parser.add_argument("--split", default="train", help="stored in extra_info.split")
    args = parser.parse_args(argv)
    path = convert_gsm8k_file(args.input, args.output, split=args.split)
    print(f"wrote {len(read_rows(path))} rows ({args.split}) to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
