"""The rollout pipeline: which weights generate each step's batch, what overlaps, errors, checkpoints."""

from __future__ import annotations

import threading

import pytest
import torch

from ballast.protocol import Batch
from ballast.trainer.step.rollout_pipeline import (Ahead, Rollout, RolloutPipeline, idle_metrics, load_rollouts_ahead,
                                                   save_rollouts_ahead, staleness_metrics)


class _Loop:
    """A trainer loop in miniature: `updates` counts finished steps (the weight version); launch records
    the version current when a step's generation is submitted, as `launch_rollout` does; the data hands
    out prompts numbered 1, 2, ... in order (`drawn`)."""

    def __init__(self, ahead, last_step=8, finish=None):
        self.updates, self.launched, self.drawn = 0, [], []
        self.pipeline = RolloutPipeline(self.draw, self.launch, finish or self.finish, ahead, last_step)

    def draw(self, step):
        self.drawn.append(len(self.drawn) + 1)
        return Batch({"prompt": torch.full((2, 1), float(self.drawn[-1]))})

    def launch(self, step, prompts):
        self.launched.append((step, int(prompts["prompt"][0])))
        return step, self.updates

    @staticmethod
    def finish(pending):
        step, version = pending
        return Rollout(step, version, Batch({"x": torch.full((4, 1), float(step))}))

    def run(self, steps):
        taken = []
        for step in steps:
            rollout, _ = self.pipeline.take(step)
            taken.append(rollout)
            self.updates += 1
            self.pipeline.launch_through(step + 1 + self.pipeline.ahead)  # as the trainer, after its update
        return taken


@pytest.mark.parametrize("ahead", [0, 1, 2, 3])
def test_a_sample_is_at_most_ahead_updates_old_and_exactly_that_once_the_pipeline_is_full(ahead):
    loop = _Loop(ahead)
    taken = loop.run(range(1, 9))
    assert [r.step for r in taken] == list(range(1, 9))
    # step s is launched after update s - ahead - 1 (or before step 1)
    assert [r.version for r in taken] == [max(0, s - ahead - 1) for s in range(1, 9)]
    ages = [staleness_metrics(r, r.step)["training/off_policy/trajectory_staleness/max"] for r in taken]
    assert ages == [min(s - 1, ahead) for s in range(1, 9)]
    assert loop.launched == [(s, s) for s in range(1, 9)]  # each step launched once, none past the last


def test_ahead_zero_launches_the_next_step_after_the_update():
    loop = _Loop(0)
    loop.pipeline.take(1)
    assert loop.launched == [(1, 1)]
    loop.updates += 1
    loop.pipeline.launch_through(2)
    assert loop.launched == [(1, 1), (2, 2)]
    assert loop.pipeline.take(2)[0].version == 1  # generated with the updated weights: synchronous


def test_the_next_batch_is_finished_while_the_current_step_trains():
    # finish(2) can only complete once step 1's "training" has started: without overlap this deadlocks.
    training = threading.Event()

    def finish(pending):
        step, version = pending
        if step == 2 and not training.wait(timeout=20):
            raise TimeoutError("step 2 was not finished concurrently with step 1's training")
        return Rollout(step, version, Batch({"x": torch.zeros(1, 1)}))

    loop = _Loop(1, last_step=2, finish=finish)
    loop.pipeline.take(1)  # launches steps 1 and 2
    training.set()  # step 1 trains now; the helper thread finishes step 2 meanwhile
    rollout, _ = loop.pipeline.take(2)
    assert rollout.step == 2


def test_an_error_surfaces_when_its_step_is_taken_and_earlier_steps_still_train():
    def finish(pending):
        step, version = pending
        if step == 3:
            raise RuntimeError("worker 1 died generating step 3")
        return Rollout(step, version, Batch({"x": torch.zeros(1, 1)}))

    loop = _Loop(1, finish=finish)
    assert [r.step for r in loop.run([1, 2])] == [1, 2]  # step 3 was launched (and failed) during step 2
    with pytest.raises(RuntimeError, match="step 3"):
        loop.pipeline.take(3)


def test_a_launch_error_waits_for_its_step():
    def draw(step):
        if step == 2:
            raise LookupError("the training data is used up")
        return Batch({"prompt": torch.zeros(2, 1)})

    pipeline = RolloutPipeline(draw, lambda step, prompts: (step, 0), _Loop.finish, 1, 5)
    assert pipeline.take(1)[0].step == 1  # launching step 2 already failed, step 1 is unaffected
    with pytest.raises(LookupError, match="used up"):
        pipeline.take(2)


def test_rollouts_generated_ahead_survive_a_checkpoint(tmp_path):
    loop = _Loop(2)
    loop.run([1, 2, 3])
    ahead = loop.pipeline.saved_ahead(4)
    assert [r.step for r in ahead.rollouts] == [4, 5, 6] and ahead.relaunch == []
    save_rollouts_ahead(str(tmp_path), ahead)
    resumed = _Loop(2)
    resumed.updates, resumed.drawn = 3, list(loop.drawn)  # the data position is restored past step 6
    resumed.pipeline.restore(load_rollouts_ahead(str(tmp_path)))
    taken = resumed.run([4, 5, 6, 7])
    assert [r.version for r in taken] == [1, 2, 3, 4]  # 4, 5 and 6 as generated before the checkpoint
    assert torch.equal(taken[0].batch["x"], ahead.rollouts[0].batch["x"])
    assert resumed.launched == [(7, 7), (8, 8)]  # the restored steps are not generated again


def test_a_generation_that_failed_ahead_is_generated_again_on_resume_with_its_own_prompts(tmp_path):
    # The checkpoint after step 2 (one step ahead): step 3 finished, step 4 (launched after step 2's
    # update) failed. The data position is past step 4's prompts, so they go into the checkpoint: the
    # resumed run generates them at step 4, on its current weights (version 2, as the uninterrupted
    # run), and step 5 draws the next prompts. Before, step 4 trained on step 5's prompts.
    def finish(pending):
        step, version = pending
        if step == 4:
            raise RuntimeError("the reward function raised on step 4's batch")
        return _Loop.finish(pending)

    loop = _Loop(1, finish=finish)
    loop.run([1, 2])
    ahead = loop.pipeline.saved_ahead(3)
    assert [r.step for r in ahead.rollouts] == [3]
    assert [(step, int(p["prompt"][0])) for step, p in ahead.relaunch] == [(4, 4)]
    save_rollouts_ahead(str(tmp_path), ahead)
    resumed = _Loop(1)
    resumed.updates, resumed.drawn = 2, list(loop.drawn)
    resumed.pipeline.restore(load_rollouts_ahead(str(tmp_path)))
    taken = resumed.run([3, 4, 5, 6])
    assert [r.version for r in taken] == [1, 2, 3, 4]
    assert resumed.launched == [(s, s) for s in range(4, 9)]  # every prompt once, at its own step
    # several steps ahead: from the first failure on, every launched step's prompts are kept (a
    # finished one after the failure is generated again: the queue restarts at the failed step)
    loop = _Loop(2, finish=finish)
    loop.run([1, 2])
    ahead = loop.pipeline.saved_ahead(3)
    assert [r.step for r in ahead.rollouts] == [3]
    assert [(step, int(p["prompt"][0])) for step, p in ahead.relaunch] == [(4, 4), (5, 5)]


def test_no_rollouts_ahead_writes_nothing(tmp_path):
    save_rollouts_ahead(str(tmp_path), Ahead())
    assert list(tmp_path.iterdir()) == [] and load_rollouts_ahead(str(tmp_path)) == Ahead()


def test_steps_are_taken_in_order():
    loop = _Loop(1)
    loop.pipeline.take(1)
    with pytest.raises(RuntimeError, match="step 3 taken, but step 2 is next"):
        loop.pipeline.take(3)


def test_idle_ratios():
    m = idle_metrics({"step": 2.0, "wait_rollout": 0.5, "gen_workers": 0.5})
    assert m == {"perf/trainer_idle_ratio": 0.25, "perf/rollout_idle_ratio": 0.75}
    assert idle_metrics({"step": 0.0}) == {}


def test_a_checkpoint_keeps_the_rollouts_ahead_before_a_failed_launch(tmp_path):
    # the data runs out while launching step 5: a checkpoint after step 3 keeps step 4 and does not
    # raise; the failure stays queued for the step that needs it
    def draw(step):
        if step >= 5:
            raise LookupError("the training data is used up")
        return Batch({"prompt": torch.zeros(2, 1)})

    pipeline = RolloutPipeline(draw, lambda step, prompts: (step, 0), _Loop.finish, 2, 8)
    for step in (1, 2, 3):
        pipeline.take(step)
        pipeline.launch_through(step + 3)
    ahead = pipeline.saved_ahead(4)
    assert [r.step for r in ahead.rollouts] == [4] and ahead.relaunch == []  # step 5 drew no prompts
    assert pipeline.saved_ahead(5) == Ahead()  # the queue starts at step 4: nothing after a step not yet taken
    assert pipeline.take(4)[0].step == 4
    with pytest.raises(LookupError, match="used up"):
        pipeline.take(5)


def test_partial_rollouts_stale_by_their_freshest_token_worst_by_their_oldest_with_their_spans():
    """Step 6 trains on a batch launched with version 3 whose rows were resumed under 4 and 5: verl's
    three figures per sample; a row whose model sampled nothing keeps its call's version."""
    versions = torch.tensor([[3, 3, 4, 5, -1],    # spans 3..5
                             [3, 3, 3, -1, -1],   # never interrupted
                             [4, 4, -1, -1, -1],  # added after the update to 4 (not started before it)
                             [-1, -1, -1, -1, -1]])
    ages = staleness_metrics(Rollout(6, 3, Batch({"rollout_versions": versions})), 6)
    stale, worst, spans = (f"training/off_policy/{k}" for k in ("trajectory_staleness", "trajectory_staleness_worst",
                                                               "trajectory_spans"))
    # freshest versions 5, 3, 4, 3 -> ages 0, 2, 1, 2; oldest 3, 3, 4, 3 -> 2, 2, 1, 2; spans 3, 1, 1, 1
    assert (ages[f"{stale}/min"], ages[f"{stale}/max"], ages[f"{stale}/mean"]) == (0.0, 2.0, 1.25)
    assert (ages[f"{worst}/min"], ages[f"{worst}/max"], ages[f"{worst}/mean"]) == (1.0, 2.0, 1.75)
    assert (ages[f"{spans}/min"], ages[f"{spans}/max"], ages[f"{spans}/mean"]) == (1.0, 3.0, 1.5)
    whole = staleness_metrics(Rollout(6, 3, Batch({"x": torch.zeros(4, 1)})), 6)
    assert whole[f"{spans}/max"] == 1.0 and whole[f"{stale}/mean"] == whole[f"{worst}/mean"] == 2.0
