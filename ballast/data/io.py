"""Reading and writing row files (verl parquet and JSONL) with errors that name the file and row.

Rows are plain Python dicts; nested columns (chat messages, ``reward_model``, ``extra_info``) come
back as lists and dicts, the same shapes verl's parquet files hold.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PARQUET_SUFFIXES = (".parquet",)
JSONL_SUFFIXES = (".jsonl", ".json")


def file_format(path: str | os.PathLike) -> str:
    """"parquet" or "jsonl" from the file name; anything else is a ValueError naming the file."""
    name = str(path).lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    raise ValueError(
        f"{str(path)!r}: unsupported data file type; expected one of {PARQUET_SUFFIXES + JSONL_SUFFIXES}"
    )


def read_rows(path: str | os.PathLike) -> list[dict]:
    """All rows of one parquet or JSONL (one JSON object per line) file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if file_format(path) == "parquet":
        return _read_parquet(path)
    return _read_jsonl(path)


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"data file {str(path)!r} is not a readable parquet file: {err}") from err
    return table.to_pylist()


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue  # tolerate blank lines (e.g. a trailing newline)
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"data file {str(path)!r} line {line_number}: invalid JSON ({err})") from err
            if not isinstance(row, dict):
                raise ValueError(
                    f"data file {str(path)!r} line {line_number}: expected a JSON object, got {type(row).__name__}"
                )
            rows.append(row)
    return rows


def write_parquet(rows: list[dict], path: str | os.PathLike) -> Path:
    """Write rows (dicts with the same keys) to a parquet file, atomically; returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)
    return path


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> Path:
    """Write rows as JSON lines, atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path
