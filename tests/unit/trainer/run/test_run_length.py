"""A run reads at most `trainer.total_epochs` passes over its training data, as verl's loop does: when a
step needs more batches than the epochs hold (dynamic sampling draws several per step), training stops
after the last complete step, says so on the console, and checkpoints that step when checkpoints are on."""

from types import SimpleNamespace

import pytest

from ballast.data.gsm8k import gsm8k_rows
from ballast.data.io import write_parquet
from ballast.models import load_tokenizer, tiny_model_dir
from ballast.trainer.config import load_config
from ballast.trainer.run.data import DataExhausted, RunData
from ballast.trainer.ray_trainer import RayPPOTrainer
from ballast.trainer.step.rollout_weights import RolloutWeights
from ballast.trainer.step.rollout_pipeline import Rollout, RolloutPipeline


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny_model_dir())


@pytest.fixture()
def gsm8k_file(tmp_path):
    records = [{"question": f"What is {k} plus {k}?", "answer": f"{k} + {k} = {2 * k}\n#### {2 * k}"} for k in range(6)]
    return str(write_parquet(gsm8k_rows(records, split="train"), tmp_path / "train.parquet"))


def _run_data(model_dir, train_file, *overrides):
    cfg = load_config([f"data.train_files={train_file}", f"actor_rollout_ref.model.path={model_dir}",
                       "data.train_batch_size=2", "data.max_prompt_length=256", *overrides])
    return RunData(cfg, load_tokenizer(model_dir))


def test_prompts_stop_after_total_epochs_of_data(model_dir, gsm8k_file):
    data = _run_data(model_dir, gsm8k_file, "trainer.total_epochs=2")
    assert data.total_steps == 6  # 2 epochs x 3 batches of 2 prompts
    seen = [tuple(data.next_prompts(step)["index"]) for step in range(1, 7)]
    assert sorted(i for batch in seen[:3] for i in batch) == list(range(6)) == sorted(i for b in seen[3:] for i in b)
    with pytest.raises(DataExhausted, match=r"training data of trainer.total_epochs=2 is used up "
                                            r"\(2 x 3 batches of 2 prompts\)"):
        data.next_prompts(7)
    resumed = _run_data(model_dir, gsm8k_file, "trainer.total_epochs=2")
    resumed.load_state_dict(data.state_dict())  # a checkpoint of the last step: nothing left to read either
    with pytest.raises(DataExhausted):
        resumed.next_prompts(7)


def test_generation_batches_count_against_the_epochs_too(model_dir, gsm8k_file):
    # DAPO: batches of data.gen_batch_size prompts; 6 prompts / 3 = 2 generation batches per epoch
    data = _run_data(model_dir, gsm8k_file, "trainer.total_epochs=1", "data.gen_batch_size=3",
                     "algorithm.filter_groups.enable=True", "actor_rollout_ref.rollout.n=2")
    assert data.total_steps == 2 and len(data.next_prompts(1, uid_prefix="a")) == 3
    data.next_prompts(1, uid_prefix="b")
    with pytest.raises(DataExhausted, match="trainer.total_epochs=1 is used up"):
        data.next_prompts(1, uid_prefix="c")


class _Tracker:
    def __init__(self):
        self.lines, self.logged = [], []

    def rewind(self, step):
        pass

    def log(self, metrics, step):
        self.logged.append(step)

    def console(self, line):
        self.lines.append(line)


def _trainer(steps_with_data, save_freq, total_steps=10, ahead=0):
    """A RayPPOTrainer whose steps are instant and whose data lasts `steps_with_data` steps; its rollout
    pipeline generates `ahead` steps ahead."""
    cfg = load_config(["data.train_files=/d", "actor_rollout_ref.model.path=/m", "trainer.test_freq=-1",
                       "trainer.val_before_train=False", f"trainer.save_freq={save_freq}"])
    trainer = object.__new__(RayPPOTrainer)
    drawn, saved = [], []

    def next_prompts(step, uid_prefix=None):
        if len(drawn) == steps_with_data:
            raise DataExhausted("the training data of trainer.total_epochs=1 is used up")
        drawn.append(step)
        return step

    trainer.cfg, trainer.total_steps, trainer.global_step = cfg, total_steps, 0
    trainer.data = SimpleNamespace(next_prompts=next_prompts, val=None)
    trainer.tracker, trainer._pending_metrics = _Tracker(), {}
    trainer.rollouts = RolloutPipeline(next_prompts, lambda step, prompts: prompts, lambda prompts: Rollout(prompts, 0, None),
                                       ahead, total_steps)
    trainer.rollout_weights = RolloutWeights(SimpleNamespace(rollout=None))  # colocated: nothing to export

    def train_step(step):
        rollout, _ = trainer.rollouts.take(step)
        return {"training/global_step": float(rollout.step)}

    trainer.train_step = train_step
    trainer.drawn = drawn
    trainer.save_checkpoint = lambda: saved.append(trainer.global_step)
    return trainer, saved


@pytest.mark.parametrize("ahead", [0, 2])
@pytest.mark.parametrize("save_freq, saves", [(2, [2, 3]), (3, [3]), (-1, [])])
def test_training_stops_when_the_data_runs_out_and_says_so(save_freq, saves, ahead):
    # Generated ahead or not, the steps whose data exists train; the first without data ends the run.
    trainer, saved = _trainer(steps_with_data=3, save_freq=save_freq, ahead=ahead)
    last = trainer.fit()
    assert trainer.global_step == 3 and last["training/global_step"] == 3.0 and trainer.tracker.logged == [1, 2, 3]
    assert trainer.tracker.lines == ["ballast: the training data of trainer.total_epochs=1 is used up: training "
                                     "stops after step 3 of the 10 planned"]
    assert saved == saves  # the last trained step is checkpointed once when checkpoints are on


@pytest.mark.parametrize("ahead", [0, 1])
def test_a_run_whose_data_lasts_its_steps_ends_without_a_notice(ahead):
    # Nothing is drawn past the last step, even when generating ahead.
    trainer, saved = _trainer(steps_with_data=10, save_freq=5, ahead=ahead)
    trainer.fit()
    assert trainer.global_step == 10 and trainer.tracker.lines == [] and saved == [5, 10]
    assert trainer.drawn == list(range(1, 11))
