"""verl's V1 trainer-mode keys: the staleness bound, the correction default for stale samples, the rules."""

from __future__ import annotations

import pytest

from ballast.trainer.config import ConfigError, check_rules, load_config
from ballast.trainer.config.off_policy import staleness_bound, warmup_steps

BASE = ["data.train_files=/d", "actor_rollout_ref.model.path=/m"]


def _load(*overrides):
    return load_config(BASE + list(overrides))


def test_sync_is_the_default_and_changes_nothing():
    cfg = _load()
    assert cfg.trainer.v1.trainer_mode == "sync" and staleness_bound(cfg) == 0
    assert not cfg.algorithm.rollout_correction.bypass_mode and not cfg.actor_rollout_ref.rollout.calculate_log_probs


def test_colocate_async_turns_on_the_correction_and_says_so(capsys):
    cfg = _load("trainer.v1.trainer_mode=colocate_async", "trainer.v1.colocate_async.num_warmup_batches=2")
    assert staleness_bound(cfg) == 2
    assert cfg.algorithm.rollout_correction.bypass_mode and cfg.actor_rollout_ref.rollout.calculate_log_probs
    assert "rollout correction is on by default" in capsys.readouterr().out
    check_rules(cfg)


def test_a_correction_the_user_names_is_kept():
    cfg = _load("trainer.v1.trainer_mode=colocate_async", "algorithm.rollout_correction.rollout_is=token",
                "actor_rollout_ref.rollout.calculate_log_probs=True")
    rc = cfg.algorithm.rollout_correction
    assert rc.rollout_is == "token" and not rc.bypass_mode  # decoupled token TIS, as asked
    check_rules(cfg)


def test_zero_batches_ahead_is_the_synchronous_trainer():
    cfg = _load("trainer.v1.trainer_mode=colocate_async", "trainer.v1.colocate_async.num_warmup_batches=0")
    assert staleness_bound(cfg) == 0 and not cfg.algorithm.rollout_correction.bypass_mode
    check_rules(cfg)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.v1.colocate_async.num_warmup_batches=-1"], "num_warmup_batches=-1.0 must be a number of batches >= 0"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"], "bypass_mode=true trains with"),
])
def test_colocate_async_rules_name_the_keys(overrides, message):
    cfg = _load("trainer.v1.trainer_mode=colocate_async", *overrides)
    with pytest.raises(ConfigError, match=message):
        check_rules(cfg)
        from ballast.trainer.step.rollout_correction import rollout_correction_settings
        rollout_correction_settings(cfg)


SPLIT = ["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.hybrid_engine=False",
         "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "trainer.v1.separate_async.parameter_sync_step=4"]


def test_separate_pools_size_the_rollout_from_its_own_pool(capsys):
    from ballast.trainer.config import derive_sizes
    from ballast.trainer.run.builders import worker_specs

    cfg = _load(*SPLIT, "trainer.n_gpus_per_node=4", "trainer.v1.separate_async.num_warmup_batches=1",
                "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.rollout.n=8")
    check_rules(cfg)
    assert staleness_bound(cfg) == 1 and cfg.algorithm.rollout_correction.bypass_mode  # stale: corrected
    assert "separate_async trains on samples up to 1 update(s) old" in capsys.readouterr().out
    sizes = derive_sizes(cfg)
    assert sizes.world_size == 4 and sizes.rollout_dp == 2 and sizes.rollout_samples_per_rank == 8 * 8 // 2
    specs = worker_specs(cfg, sizes, total_steps=10)
    trainer, rollout = specs.actor_rollout_ref, specs.rollout
    assert trainer.actor is not None and trainer.rollout is None and trainer.agent is None
    assert rollout.actor is None and rollout.ref is None and rollout.rollout is not None
    assert trainer.weight_sync.check and rollout.weight_sync.check  # on by default: weights cross processes
    assert trainer.weight_sync.transfer_dtype == "auto"  # the rollout's dtype setting, resolved on the trainer


def test_zero_batches_ahead_on_separate_pools_needs_no_correction():
    cfg = _load(*SPLIT, "trainer.v1.separate_async.num_warmup_batches=0")
    check_rules(cfg)
    assert staleness_bound(cfg) == 0 and not cfg.algorithm.rollout_correction.bypass_mode


@pytest.mark.parametrize("change, message", [
    ("actor_rollout_ref.hybrid_engine=True", "separate_async needs actor_rollout_ref.hybrid_engine=false"),
    ("actor_rollout_ref.rollout.nnodes=0", "rollout.nnodes=0 must be > 0 with trainer.v1.trainer_mode=separate_async"),
    ("trainer.v1.separate_async.parameter_sync_step=2",
     "train_batch_size=8 must equal trainer.v1.separate_async.parameter_sync_step=2 x .*ppo_mini_batch_size=2"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=3", "not divisible by .*tensor_model_parallel_size=3"),
])
def test_separate_pools_rules_name_the_keys(change, message):
    from ballast.trainer.config import derive_sizes

    cfg = _load(*SPLIT, change)
    with pytest.raises(ConfigError, match=message):
        check_rules(cfg)
        derive_sizes(cfg)


PARTIAL = [*SPLIT, "trainer.v1.separate_async.partial_rollout=true", "actor_rollout_ref.rollout.mode=async"]


def test_partial_rollouts_are_off_by_default_and_accepted_with_their_needs():
    assert not _load(*SPLIT).trainer.v1.separate_async.partial_rollout
    cfg = _load(*PARTIAL)
    check_rules(cfg)
    assert cfg.trainer.v1.separate_async.partial_rollout and cfg.algorithm.rollout_correction.bypass_mode


@pytest.mark.parametrize("change, message", [
    ("trainer.v1.separate_async.num_warmup_batches=0",
     "partial_rollout=true with trainer.v1.separate_async.num_warmup_batches=0: nothing is being generated"),
    ("actor_rollout_ref.rollout.mode=sync", "partial_rollout=true needs actor_rollout_ref.rollout.mode=async"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2",
     "partial_rollout=true needs actor_rollout_ref.rollout.tensor_model_parallel_size=1, got 2"),
])
def test_partial_rollout_rules_name_the_keys(change, message):
    with pytest.raises(ConfigError, match=message):
        check_rules(_load(*PARTIAL, change))


def test_split_resources_without_separate_async_are_refused():
    with pytest.raises(ConfigError, match="hybrid_engine=False with trainer.v1.trainer_mode=colocate_async"):
        check_rules(_load("trainer.v1.trainer_mode=colocate_async", "actor_rollout_ref.hybrid_engine=False"))


def test_an_unknown_mode_is_refused_by_the_loader():
    with pytest.raises(ConfigError, match="trainer.v1.trainer_mode='fully_async' is not one of"):
        _load("trainer.v1.trainer_mode=fully_async")


def test_dynamic_sampling_is_accepted_with_batches_ahead():
    cfg = _load("trainer.v1.trainer_mode=colocate_async", "algorithm.filter_groups.enable=True",
                "actor_rollout_ref.rollout.n=2")
    assert staleness_bound(cfg) == 1 and cfg.algorithm.rollout_correction.bypass_mode
    check_rules(cfg)


@pytest.mark.parametrize("value, ahead", [(1.5, 1), (0.5, 0), (2, 2), (2.999, 2), (0, 0)])
def test_fractional_warmup_batches_round_down_to_whole_steps(value, ahead):
    # verl's prompt window with gen_batch_size == train_batch_size: floor(value) batches
    assert warmup_steps(value) == ahead


def test_a_rounded_warmup_is_announced(capsys):
    cfg = _load("trainer.v1.trainer_mode=colocate_async", "trainer.v1.colocate_async.num_warmup_batches=1.5",
                "data.train_batch_size=8")
    assert staleness_bound(cfg) == 1 and cfg.algorithm.rollout_correction.bypass_mode
    out = capsys.readouterr().out
    assert "num_warmup_batches=1.5: Ballast generates whole steps ahead; 1 step(s) are generated ahead" in out
    check_rules(cfg)


def test_a_warmup_below_one_batch_is_the_synchronous_trainer(capsys):
    cfg = _load("trainer.v1.trainer_mode=colocate_async", "trainer.v1.colocate_async.num_warmup_batches=0.5")
    assert staleness_bound(cfg) == 0 and not cfg.algorithm.rollout_correction.bypass_mode
    assert "0 step(s) are generated ahead" in capsys.readouterr().out
