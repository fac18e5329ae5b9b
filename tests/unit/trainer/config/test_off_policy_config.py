"""The overlap keys: verl's `trainer.use_v1` / `trainer.v1.*` with verl's meaning (or a start-up error that
says what Ballast offers instead), Ballast's own `trainer.ballast_overlap.*`, the correction default
for stale samples, and the learning-rate horizon of every mode."""

from __future__ import annotations

import pytest

from ballast.trainer.config import ConfigError, ModelInfo, check_rules, load_config
from ballast.trainer.config.off_policy import Overlap, overlap, whole_batches
from ballast.trainer.run.run_plan import plan_run

BASE = ["data.train_files=/d", "actor_rollout_ref.model.path=/m"]
TINY = ModelInfo(4, 2, 128, 2, 256, 512, 2048)


def _load(*overrides):
    return load_config(BASE + list(overrides))


def test_sync_is_the_default_and_changes_nothing():
    cfg = _load()
    assert cfg.trainer.use_v1 and cfg.trainer.v1.trainer_mode == "sync"
    assert overlap(cfg) == Overlap(split_pools=False, batches_ahead=0, partial_rollout=False, local_updates=1)
    assert not cfg.algorithm.rollout_correction.bypass_mode
    sampler = cfg.trainer.v1.sampler  # verl's keys and defaults, known here
    assert (sampler.max_off_policy_threshold, sampler.max_off_policy_strategy) == (8, "drop")
    check_rules(cfg)


def test_batches_ahead_is_ballasts_colocated_overlap_and_turns_on_the_correction(capsys):
    cfg = _load("trainer.ballast_overlap.batches_ahead=2")
    assert overlap(cfg) == Overlap(False, 2, False, 1)
    assert cfg.algorithm.rollout_correction.bypass_mode and cfg.actor_rollout_ref.rollout.calculate_log_probs
    assert "rollout correction is on by default" in capsys.readouterr().out
    check_rules(cfg)


def test_a_correction_the_user_names_is_kept():
    cfg = _load("trainer.ballast_overlap.batches_ahead=1", "algorithm.rollout_correction.rollout_is=token",
                "actor_rollout_ref.rollout.calculate_log_probs=True")
    rc = cfg.algorithm.rollout_correction
    assert rc.rollout_is == "token" and not rc.bypass_mode  # decoupled token TIS, as asked
    check_rules(cfg)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.ballast_overlap.batches_ahead=-1"], "batches_ahead=-1 must be a whole number of batches >= 0"),
    (["trainer.ballast_overlap.batches_ahead=1", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
     "bypass_mode=true trains with"),
    (["trainer.ballast_overlap.partial_rollout=true"], "partial_rollout=true needs trainer.v1.trainer_mode=separate_async"),
])
def test_colocated_overlap_rules_name_the_keys(overrides, message):
    cfg = _load(*overrides)
    with pytest.raises(ConfigError, match=message):
        check_rules(cfg)
        from ballast.trainer.step.rollout_correction import rollout_correction_settings
        rollout_correction_settings(cfg)


def test_verls_colocate_async_is_refused_naming_what_ballast_offers():
    # verl's colocate_async resumes interrupted generations colocated and samples from a replay buffer;
    # Ballast's former meaning of the key (whole batches ahead) now has a key of its own
    with pytest.raises(ConfigError, match="colocate_async is verl's colocated asynchronous trainer.*"
                       "trainer.ballast_overlap.batches_ahead=k.*trainer.v1.trainer_mode=separate_async"):
        check_rules(_load("trainer.v1.trainer_mode=colocate_async"))
    with pytest.raises(ConfigError, match="colocate_async"):
        overlap(_load("trainer.v1.trainer_mode=colocate_async", "trainer.v1.colocate_async.num_warmup_batches=0"))


def test_use_v1_is_verls_switch_to_the_legacy_synchronous_trainer():
    cfg = _load("trainer.use_v1=false")
    check_rules(cfg)
    assert overlap(cfg) == Overlap(False, 0, False, 1)
    with pytest.raises(ConfigError, match="trainer.use_v1=false runs verl's legacy trainer.*trainer_mode=separate_async"):
        check_rules(_load("trainer.use_v1=false", *SPLIT))


@pytest.mark.parametrize("overrides, message", [
    (["trainer.v1.sampler.max_off_policy_threshold=0"], "max_off_policy_threshold=0 must be an integer >= 1, or null"),
    (["trainer.v1.sampler.custom_sampler.path=/my/sampler.py", "trainer.v1.sampler.custom_sampler.name=Buffer"],
     "custom_sampler .* replaces verl's replay buffer; Ballast has none"),
])
def test_sampler_values_ballast_cannot_honour_are_start_up_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_rules(_load(*overrides))


def test_sampler_keys_are_known_and_checked_by_the_loader():
    cfg = _load("trainer.v1.sampler.max_off_policy_threshold=null", "trainer.v1.sampler.max_off_policy_strategy=wait",
                "trainer.v1.sampler.sync_refill_failed_groups=true", "+trainer.v1.sampler.sampler_kwargs.alpha=1")
    assert cfg.trainer.v1.sampler.max_off_policy_threshold is None and cfg.trainer.v1.sampler.sampler_kwargs == {"alpha": 1}
    check_rules(cfg)
    with pytest.raises(ConfigError, match="max_off_policy_strategy='evict' is not one of 'drop', 'wait'"):
        _load("trainer.v1.sampler.max_off_policy_strategy=evict")


SPLIT = ["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.hybrid_engine=False",
         "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2",
         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "trainer.v1.separate_async.parameter_sync_step=4"]
ASYNC_ROLLOUT = "actor_rollout_ref.rollout.mode=async"


def test_separate_async_resumes_interrupted_generations_by_default_as_verl(capsys):
    from ballast.trainer.config import derive_sizes
    from ballast.trainer.run.builders import worker_specs
    from ballast.trainer.step.old_log_probs import old_log_prob_source

    cfg = _load(*SPLIT, ASYNC_ROLLOUT, "trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.use_dynamic_bsz=True",
                "actor_rollout_ref.rollout.n=8")
    check_rules(cfg)
    assert overlap(cfg) == Overlap(split_pools=True, batches_ahead=1, partial_rollout=True, local_updates=4)
    assert cfg.algorithm.rollout_correction.bypass_mode  # stale: corrected
    assert "samples up to 1 update(s) old" in capsys.readouterr().out
    sizes = derive_sizes(cfg)
    assert sizes.world_size == 4 and sizes.rollout_dp == 2 and sizes.rollout_samples_per_rank == 8 * 8 // 2
    specs = worker_specs(cfg, sizes, 10, old_log_prob_source(cfg, sizes))
    trainer, rollout = specs.actor_rollout_ref, specs.rollout
    assert trainer.actor is not None and trainer.rollout is None and trainer.agent is None
    assert rollout.actor is None and rollout.ref is None and rollout.rollout is not None
    assert trainer.weight_sync.check and rollout.weight_sync.check  # on by default: weights cross processes


def test_partial_rollouts_off_is_ballasts_whole_batch_bound_on_split_pools():
    cfg = _load(*SPLIT, "trainer.ballast_overlap.partial_rollout=false")  # batched rollout: no interruption needed
    check_rules(cfg)
    assert overlap(cfg) == Overlap(True, 1, False, 4)


def test_no_window_on_separate_pools_interrupts_nothing_and_needs_no_correction():
    cfg = _load(*SPLIT, "trainer.v1.separate_async.num_warmup_batches=0")
    check_rules(cfg)  # partial rollouts have nothing to interrupt: the batched rollout is fine
    assert overlap(cfg) == Overlap(True, 0, False, 4) and not cfg.algorithm.rollout_correction.bypass_mode


@pytest.mark.parametrize("change, message", [
    ("actor_rollout_ref.hybrid_engine=True", "separate_async needs actor_rollout_ref.hybrid_engine=false"),
    ("actor_rollout_ref.rollout.nnodes=0", "rollout.nnodes=0 must be > 0 with trainer.v1.trainer_mode=separate_async"),
    ("trainer.v1.separate_async.parameter_sync_step=2",
     "train_batch_size=8 must equal trainer.v1.separate_async.parameter_sync_step=2 x .*ppo_mini_batch_size=2"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=3", "not divisible by .*tensor_model_parallel_size=3"),
    ("trainer.v1.separate_async.num_warmup_batches=1.5", "num_warmup_batches=1.5 must be a whole number of batches"),
    ("trainer.v1.separate_async.num_warmup_batches=8",
     "num_warmup_batches=8 keeps every batch in flight for 9 steps, more than .*max_off_policy_threshold=8"),
    ("trainer.ballast_overlap.batches_ahead=1", "batches_ahead=1 is the colocated window; .*num_warmup_batches"),
    ("algorithm.adv_estimator=gae", None),  # the critic's mini-batch (= the actor's) fits each share
])
def test_separate_pools_rules_name_the_keys(change, message):
    from ballast.trainer.config import derive_sizes

    cfg = _load(*SPLIT, "trainer.ballast_overlap.partial_rollout=false", change)
    if message is None:
        check_rules(cfg)
        return
    with pytest.raises(ConfigError, match=message):
        check_rules(cfg)
        derive_sizes(cfg)


SMALL = [ASYNC_ROLLOUT, "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.n=2",
         "actor_rollout_ref.actor.use_dynamic_bsz=True", "critic.use_dynamic_bsz=True"]


def test_a_critic_mini_batch_larger_than_a_local_update_is_refused():
    from ballast.trainer.config import derive_sizes

    with pytest.raises(ConfigError, match="the prompts of each local update .*parameter_sync_step=4.*=2 is not "
                       "divisible by critic.ppo_mini_batch_size=4"):
        derive_sizes(_load(*SPLIT, *SMALL, "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=4"))
    derive_sizes(_load(*SPLIT, *SMALL, "algorithm.adv_estimator=grpo", "critic.ppo_mini_batch_size=4"))  # no critic


def test_a_window_counted_in_generation_batches_would_differ_from_verls():
    with pytest.raises(ConfigError, match="data.gen_batch_size=16 != data.train_batch_size=8"):
        check_rules(_load(*SPLIT, ASYNC_ROLLOUT, "algorithm.filter_groups.enable=True", "data.gen_batch_size=16",
                          "actor_rollout_ref.rollout.n=2"))
    check_rules(_load(*SPLIT, "algorithm.filter_groups.enable=True", "data.gen_batch_size=16",
                      "actor_rollout_ref.rollout.n=2", "trainer.v1.separate_async.num_warmup_batches=0"))


def test_the_threshold_bounds_the_window_and_null_lifts_it():
    check_rules(_load(*SPLIT, ASYNC_ROLLOUT, "trainer.v1.separate_async.num_warmup_batches=7"))  # spans 8 <= 8
    check_rules(_load(*SPLIT, ASYNC_ROLLOUT, "trainer.v1.separate_async.num_warmup_batches=20",
                      "trainer.v1.sampler.max_off_policy_threshold=null"))
    # not read by the colocated modes, as verl's sync trainer ignores it
    check_rules(_load("trainer.ballast_overlap.batches_ahead=3", "trainer.v1.sampler.max_off_policy_threshold=1"))


def test_partial_rollouts_take_a_tensor_parallel_rollout():
    # the TP group's leader decides the weight switches and its followers replay them (agent_loop/tp.py)
    cfg = _load(*SPLIT, ASYNC_ROLLOUT, "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n_gpus_per_node=2",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    check_rules(cfg)
    assert overlap(cfg).partial_rollout


def test_the_former_partial_rollout_key_names_its_new_place():
    with pytest.raises(ConfigError, match="trainer.v1.separate_async.partial_rollout is not one of verl's keys.*"
                       "switch is trainer.ballast_overlap.partial_rollout"):
        check_rules(_load(*SPLIT, ASYNC_ROLLOUT, "trainer.v1.separate_async.partial_rollout=true"))


def test_hybrid_switching_is_ignored_as_verl_does_without_hybrid_replicas(capsys):
    cfg = _load(*SPLIT, ASYNC_ROLLOUT, "trainer.v1.separate_async.hybrid_rollout.enable_switch=true")
    check_rules(cfg)
    assert "hybrid_rollout.enable_switch=true is ignored, as verl does" in capsys.readouterr().out


def test_split_resources_without_separate_async_are_refused():
    with pytest.raises(ConfigError, match="hybrid_engine=False with trainer.v1.trainer_mode=sync"):
        check_rules(_load("actor_rollout_ref.hybrid_engine=False"))


def test_an_unknown_mode_is_refused_by_the_loader():
    with pytest.raises(ConfigError, match="trainer.v1.trainer_mode='fully_async' is not one of"):
        _load("trainer.v1.trainer_mode=fully_async")


def test_dynamic_sampling_is_accepted_with_batches_ahead():
    cfg = _load("trainer.ballast_overlap.batches_ahead=1", "algorithm.filter_groups.enable=True",
                "actor_rollout_ref.rollout.n=2")
    assert overlap(cfg).batches_ahead == 1 and cfg.algorithm.rollout_correction.bypass_mode
    check_rules(cfg)


@pytest.mark.parametrize("value, ahead", [(2, 2), (2.0, 2), (0, 0)])
def test_a_window_is_a_whole_number_of_batches(value, ahead):
    assert whole_batches(value, "k") == ahead
    for bad in (1.5, 0.5, -1, "x"):
        with pytest.raises(ConfigError, match="k=.* must be a whole number of batches"):
            whole_batches(bad, "k")


# The learning-rate schedule steps once per update call (as verl's): its horizon counts the local updates.
HORIZON = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.n_gpus_per_node=2",
           "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
           "data.max_prompt_length=128", "data.max_response_length=256", "trainer.device=cpu",
           "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1", "algorithm.adv_estimator=gae",
           "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "critic.optim.lr_warmup_steps_ratio=0.1"]


@pytest.mark.parametrize("mode, local_updates", [
    ([], 1),
    (["trainer.use_v1=false"], 1),  # verl's legacy trainer
    (["trainer.ballast_overlap.batches_ahead=1"], 1),
    ([*SPLIT[:4], ASYNC_ROLLOUT, "trainer.v1.separate_async.parameter_sync_step=4"], 4),
    ([*SPLIT[:4], "trainer.ballast_overlap.partial_rollout=false", "trainer.v1.separate_async.parameter_sync_step=4"], 4),
])
def test_the_learning_rate_horizon_is_the_steps_times_the_local_updates(mode, local_updates):
    cfg = _load(*HORIZON, *mode)
    plan = plan_run(cfg, TINY, total_steps=10)
    assert overlap(cfg).local_updates == local_updates
    for optim in (plan.specs.actor_rollout_ref.actor.optim, plan.specs.critic.critic.optim):
        assert optim.total_steps == 10 * local_updates  # verl: optim.total_training_steps = steps x parameter_sync_step
        assert optim.warmup_steps == int(0.1 * 10 * local_updates)  # the warmup ratio of that horizon
