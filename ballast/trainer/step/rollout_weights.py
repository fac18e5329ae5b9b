"""The actor's weights on their way to a rollout pool of its own (`trainer.v1.trainer_mode=separate_async`).

After every update the trainer group exports its weights into Ray's object store (bucketed; see
`ballast.single_controller.object_store`) and the driver keeps the references until the next generate
call, which carries them: the rollout workers load them before generating. A worker group runs its
calls in submission order, so every generation submitted after an export samples with those weights
and every one submitted before it with the previous ones, the same rule that fixes the weight version
of a colocated rollout (`RolloutPipeline`). Colocated runs export nothing: their workers sync in place.

Partial rollouts (on with `separate_async` and a window, as verl's; `trainer.ballast_overlap.partial_rollout`)
add a second way in: every export is also posted to the `WeightMailbox` the rollout workers were built
with (`Workers.mailbox`), which they look into during a training generation; weights found there
interrupt the requests in flight, which resume under them. A later call that carries the same export
then has nothing to load.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, TypeVar

from ballast.workers.spec import GenerateArgs

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
            if self.workers.mailbox is not None:
                self.workers.mailbox.post.remote(self._pending)

    def call(self, generate: Callable[..., T], *args, call: GenerateArgs) -> T:
        """`generate(*args, call)`, `call` carrying the pending export (`weights`) if there is one; the
        export is handed over once, when the call was submitted without an error."""
        if self._pending is None:
            return generate(*args, call)
        result = generate(*args, dataclasses.replace(call, weights=self._pending))
        self._pending = None
        return result
