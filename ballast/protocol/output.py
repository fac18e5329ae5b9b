"""`Output`: what a worker call returns when it has metrics beside its data.

A dispatched call returns one `Output` per data-parallel rank; the controller concatenates them in
rank order (`Output.concat`), dropping any padding the dispatch added, and extends each metric's
list of per-rank values. Metrics therefore never ride in `Batch.meta`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ballast.protocol.batch import Batch


@dataclass
class Output:
    """A call's `batch` and its `metrics`: name -> one value per rank (or per event) that reported it."""

    batch: Batch
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.batch, Batch):
            raise TypeError(f"Output.batch must be a Batch, got {type(self.batch).__name__}")
        if not isinstance(self.metrics, Mapping):
            raise TypeError(f"Output.metrics must be a dict[str, list], got {type(self.metrics).__name__}")
        bad = [k for k, v in self.metrics.items() if not isinstance(v, (list, tuple))]
        if bad:
            raise TypeError(f"Output.metrics values must be lists of per-rank values; {bad} are not")
        self.metrics = {k: list(v) for k, v in self.metrics.items()}

    @staticmethod
    def concat(outputs: Sequence[Output], pad_count: int = 0) -> Output:
        """The outputs of consecutive ranks as one: batches concatenated (minus `pad_count` padding
        rows at the end), metric lists extended in order."""
        if not outputs:
            raise ValueError("Output.concat needs at least one output")
        batch = Batch.concat([o.batch for o in outputs]) if len(outputs) > 1 else outputs[0].batch
        if pad_count:
            batch = batch.unpad(pad_count)
        metrics: dict[str, list[float]] = {}
        for output in outputs:
            for name, values in output.metrics.items():
                metrics.setdefault(name, []).extend(values)
        return Output(batch, metrics)

    def mean_metrics(self) -> dict[str, float]:
        """Each metric's mean over the values reported (empty lists left out)."""
        return {k: float(sum(v) / len(v)) for k, v in self.metrics.items() if v}
