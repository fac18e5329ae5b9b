"""Convert GSM8K rows (``question``, ``answer`` with a worked solution ending in ``#### <number>``)
from a LOCAL parquet/JSONL file into verl's RL format. Nothing is downloaded.

Each output row: ``data_source="openai/gsm8k"`` (the key `ballast.data.rewards` scores with the
exact-answer reward), ``prompt`` = one user message (question + an instruction to end with
``#### <answer>``), ``ability="math"``, ``reward_model={"style": "rule", "ground_truth": "<number>"}``
and ``extra_info={"split", "index", "question", "answer"}``.
"""

from __future__ import annotations

import os
from pathlib import Path

from ballast.data.io import file_format, read_rows, write_jsonl, write_parquet

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Solve it step by step, then give the final number on the last line as "#### <number>".'


def final_answer(solution: str) -> str:
    """The number after the last ``####`` of a GSM8K solution, commas removed."""
    if "####" not in solution:
        raise ValueError("solution has no '####' final-answer marker")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise ValueError("solution has nothing after its '####' marker")
    return answer


def gsm8k_rows(records: list[dict], *, split: str, source: str = "<records>") -> list[dict]:
    """verl-format rows from GSM8K records; a bad record is a ValueError naming `source` and row."""
    rows = []
    for index, record in enumerate(records):
        where = f"{source} row {index}"
        question, solution = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{where}: field 'question' must be a non-empty string, got {question!r}")
        if not isinstance(solution, str):
            raise ValueError(f"{where}: field 'answer' must be a string, got {solution!r}")
        try:
            ground_truth = final_answer(solution)
        except ValueError as err:
            raise ValueError(f"{where}: field 'answer': {err}") from None
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": ground_truth},
                "extra_info": {"split": split, "index": index, "question": question, "answer": solution},
            }
        )
    return rows


def convert_gsm8k_file(input_path: str | os.PathLike, output_path: str | os.PathLike, *, split: str) -> Path:
    """Read a local GSM8K parquet/JSONL file and write the verl-format file (format from the suffix)."""
    rows = gsm8k_rows(read_rows(input_path), split=split, source=f"data file {str(input_path)!r}")
    if file_format(output_path) == "parquet":
        return write_parquet(rows, output_path)
    return write_jsonl(rows, output_path)
