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
from typing import Optional

from ballast.trainer.step.rollout_recovery import RolloutRecovery
from ballast.workers.spec import GenerateArgs


class RolloutWeights:
    def __init__(self, workers, recovery: Optional[RolloutRecovery] = None) -> None:
        """`recovery`: how a failed rollout pool is replaced (split pools; None: colocated, where the
        workers rebuild a failed engine in place)."""
        self.workers = workers
        self.recovery = recovery
        self._pending: Optional[object] = None  # the export no generate call has carried yet
        # The newest export: a replaced rollout pool has to be brought to it (it holds one more copy of
        # the weights in the object store until the next export replaces it).
        self._latest: Optional[object] = None

    @property
    def split(self) -> bool:
        return self.workers.rollout is not None

    def export(self, version: int) -> None:
        """Export the trainer's current weights as `version` (split pools only)."""
        if self.split:
            self._pending = self._latest = self.workers.actor_rollout.export_weights(version)[0]
            if self.workers.mailbox is not None:
                self.workers.mailbox.post.remote(self._pending)

    def submit(self, prompts, call: GenerateArgs):
        """Submit `generate_sequences(prompts, call)` to the generating group without waiting; `call`
        carries the pending export (`weights`) if there is one, handed over once. The returned future's
        `get()` gives the `Output`; on split pools it survives a failed rollout pool: the call runs again
        on the replacement, under the weights it was submitted under."""
        group = self.workers.generator
        first = call if self._pending is None else dataclasses.replace(call, weights=self._pending)
        if self.recovery is None:
            future = group.submit("generate_sequences", prompts, first)
        else:
            again = dataclasses.replace(call, weights=self._latest)
            future = self.recovery.submit(lambda: group.submit("generate_sequences", prompts, first),
                                          lambda: group.submit("generate_sequences", prompts, again))
        self._pending = None
        return future

    def generate(self, prompts, call: GenerateArgs):
        """`submit` and wait: the `Output`."""
        return self.submit(prompts, call).get()
