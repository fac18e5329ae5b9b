"""Pure split/collect logic behind the dispatch modes (no Ray): tested directly on Batches."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from ballast.protocol import Batch, Output
from ballast.single_controller.worker import MeshInfo


def split_args(args: Sequence[Any], kwargs: Dict[str, Any], num_chunks: int, pad: bool,
               what: str) -> Tuple[List[list], List[dict], int]:
    """Cut every Batch argument into `num_chunks` equal chunks; other arguments go to every chunk.

    Returns per-chunk args, per-chunk kwargs and the number of pad samples added (0 unless `pad`).
    All Batch arguments must have the same length.
    """
    sizes = {len(v) for v in list(args) + list(kwargs.values()) if isinstance(v, Batch)}
    if len(sizes) > 1:
        raise ValueError(f"{what}: Batch arguments have different lengths {sorted(sizes)}")
    pad_count = 0
    if sizes:
        size = sizes.pop()
        if size % num_chunks:
            if not pad:
                raise ValueError(
                    f"{what}: a Batch of {size} samples cannot be split evenly over {num_chunks} data-parallel "
                    f"ranks ({size} % {num_chunks} = {size % num_chunks}); make the batch size a multiple of "
                    f"{num_chunks}"
                )
            pad_count = -size % num_chunks

    def cut(value):
        if isinstance(value, Batch):
            return value.chunk(num_chunks, pad=pad_count > 0)
        return [value] * num_chunks

    cut_args = [cut(v) for v in args]
    cut_kwargs = {k: cut(v) for k, v in kwargs.items()}
    per_args = [[a[i] for a in cut_args] for i in range(num_chunks)]
    per_kwargs = [{k: v[i] for k, v in cut_kwargs.items()} for i in range(num_chunks)]
    return per_args, per_kwargs, pad_count


def concat_results(results: Sequence[Any], pad_count: int, what: str) -> Any:
    """Concatenate per-rank Batch (or `Output`) results in order and drop the padding the dispatch added."""
    if not results:
        return results
    if all(isinstance(r, Output) for r in results):
        return Output.concat(results, pad_count)
    if all(isinstance(r, Batch) for r in results):
        merged = Batch.concat(results)
        if pad_count:
            merged = merged.unpad(pad_count)
        return merged
    if any(isinstance(r, (Batch, Output)) for r in results):
        raise TypeError(f"{what}: ranks returned mixed types {[type(r).__name__ for r in results]}")
    if pad_count:
        raise TypeError(f"{what}: padding was added but the results are not Batches; cannot remove it")
    return list(results)


def mesh_layout(infos: Sequence[MeshInfo], role: str) -> Tuple[int, List[int], List[int]]:
    """Check a role's mesh declarations and return (dp_size, dp rank of each worker, collect worker per dp rank)."""
    if not infos:
        raise ValueError(f"mesh {role!r}: no workers")
    sizes = {info.dp_size for info in infos}
    if len(sizes) != 1:
        raise ValueError(f"mesh {role!r}: workers disagree on dp_size: {sorted(sizes)}")
    dp_size = sizes.pop()
    collect: List[int] = [-1] * dp_size
    for worker, info in enumerate(infos):
        if not 0 <= info.dp_rank < dp_size:
            raise ValueError(f"mesh {role!r}: worker {worker} has dp_rank {info.dp_rank} outside [0, {dp_size})")
        if info.is_collect:
            if collect[info.dp_rank] != -1:
                raise ValueError(f"mesh {role!r}: dp rank {info.dp_rank} has two collect workers "
                                 f"({collect[info.dp_rank]} and {worker})")
            collect[info.dp_rank] = worker
    missing = [r for r, w in enumerate(collect) if w == -1]
    if missing:
        raise ValueError(f"mesh {role!r}: dp ranks {missing} have no collect worker")
    return dp_size, [info.dp_rank for info in infos], collect
