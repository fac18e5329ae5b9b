"""The actor's weights on their way to a rollout pool of its own (`trainer.v1.trainer_mode=separate_async`).

After every update the trainer group exports its weights into Ray's object store (bucketed; see
`ballast.single_controller.object_store`) and the driver keeps the references until the next generate
call, which carries them: the rollout workers load them before generating. A worker group runs its
calls in submission order, so every generation submitted after an export samples with those weights
and every one submitted before it with the previous ones, the same rule that fixes the weight version
of a colocated rollout (`RolloutPipeline`). Colocated runs export nothing: their workers sync in place.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

T = TypeVar("T")


class RolloutWeights:
    def __init__(self, workers) -> None:
        self.workers = workers
        self._pending: Optional[object] = None  # the export no generate call has carried yet

    @property
    def split(self) -> bool:
        return self.workers.rollout is not None

    def export(self, version: int) -> None:
        """Export the trainer's current weights as `version` (split pools only)."""
        if self.split:
            self._pending = self.workers.actor_rollout.export_weights(version)[0]

    def call(self, generate: Callable[..., T], *args, **kwargs) -> T:
        """`generate(*args, **kwargs)`, carrying the pending export (`weights=`) if there is one; the
        export is handed over once, when the call was submitted without an error."""
        if self._pending is None:
            return generate(*args, **kwargs)
        result = generate(*args, weights=self._pending, **kwargs)
        self._pending = None
        return result
