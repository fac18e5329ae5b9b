"""The run's plan: built once from the data's step count, and the typed choices of the schema."""

import json
import pickle

import pytest

from ballast.trainer.config import ConfigError, load_config
from ballast.trainer.config.schema import Choice, KLControlType, LossAggMode, RewardManagerName, Truncation
from ballast.trainer.config.schema.choice import values

from testkit.e2e import overrides, write_tiny_task

REQUIRED = ["data.train_files=/d.parquet", "actor_rollout_ref.model.path=/m"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return write_tiny_task(tmp_path_factory.mktemp("task"))


def test_prepare_reads_the_data_then_builds_every_spec_once(task, tmp_path, monkeypatch):
    from ballast.trainer.run import run_plan
    from ballast.trainer.main import prepare_typed

    built = []
    real = run_plan.worker_specs
    monkeypatch.setattr(run_plan, "worker_specs", lambda *args: built.append(args[2]) or real(*args))
    # No trainer.total_training_steps: 2 epochs of 64 prompts in batches of 4 are 32 steps.
    extra = ["trainer.total_training_steps=null", "trainer.total_epochs=2",
             "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"]
    prepared = prepare_typed(load_config(overrides(task, str(tmp_path / "run"), *extra)))
    assert built == [32], "worker specs must be built exactly once, with the real step count"
    assert prepared.plan.total_steps == prepared.data.total_steps == 32
    assert prepared.plan.specs.actor_rollout_ref.actor.optim.total_steps == 32
    assert prepared.plan.sizes.samples_per_step == 16 and prepared.plan.specs.critic is None


@pytest.mark.parametrize("override, message", [
    ("data.train_batch_size=0", "data.train_batch_size: batch_size must be a positive int, got 0"),
    ("data.gen_batch_size=-2", "data.gen_batch_size: batch_size must be a positive int, got -2"),
    ("data.max_prompt_length=0", "data.max_prompt_length: max_prompt_length must be a positive int, got 0"),
])
def test_a_setting_the_data_read_refuses_is_a_config_error_naming_the_key(task, tmp_path, override, message):
    from ballast.trainer.main import InputError, prepare_typed

    with pytest.raises(ConfigError) as info:
        prepare_typed(load_config(overrides(task, str(tmp_path / "run"), override)))
    assert str(info.value) == message and not isinstance(info.value, InputError)


def test_schema_choices_hold_exactly_their_owners_values():
    from ballast.data import TRUNCATION_MODES
    from ballast.engine.losses import LOSS_AGG_MODES
    from ballast.trainer.algorithms.kl import KL_CONTROLLERS
    from ballast.trainer.step.reward import REWARD_MANAGERS

    assert values(LossAggMode) == tuple(LOSS_AGG_MODES)
    assert values(Truncation) == tuple(TRUNCATION_MODES)
    assert values(KLControlType) == tuple(KL_CONTROLLERS)
    assert values(RewardManagerName) == tuple(REWARD_MANAGERS)


def test_a_choice_is_its_string_everywhere_downstream():
    cfg = load_config(REQUIRED + ["actor_rollout_ref.rollout.mode=async", "data.truncation=middle"])
    mode, truncation = cfg.actor_rollout_ref.rollout.mode, cfg.data.truncation
    assert isinstance(mode, Choice) and isinstance(mode, str)
    assert mode == "async" and {"async": 1}[mode] == 1 and hash(truncation) == hash("middle")
    assert (str(mode), f"{mode}", repr(mode), json.dumps(truncation)) == ("async", "async", "'async'", '"middle"')
    assert type(str(truncation)) is str
    assert pickle.loads(pickle.dumps(truncation)) is truncation  # crosses to Ray workers inside specs


@pytest.mark.parametrize("override, message", [
    ("data.truncation=center", "data.truncation='center' is not one of 'error', 'left', 'right', 'middle', 'filter'"),
    ("actor_rollout_ref.rollout.mode=agent", "actor_rollout_ref.rollout.mode='agent' is not one of 'sync', 'async'"),
    ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type='pid' is not one of 'fixed', 'adaptive'"),
    ("critic.loss_agg_mode=sum", "critic.loss_agg_mode='sum' is not one of 'token-mean', 'seq-mean-token-sum', "
                                 "'seq-mean-token-mean', 'seq-mean-token-sum-norm'"),
    ("critic.strategy=megatron", "critic.strategy='megatron' is not one of 'fsdp', 'fsdp2'"),
])
def test_a_value_outside_a_choice_fails_on_load_naming_the_key_and_the_values(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(REQUIRED + [override])
    assert str(info.value) == message
