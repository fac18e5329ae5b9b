"""verl's DAPO command line (its keys, scaled to the tiny model) on GSM8K-format data with a score function
that returns a number: dynamic sampling on `acc` draws several generation batches in a step (their prompts
padded to different widths), validation reports `acc` as its core variable, and the run stops when its one
epoch of data is used up, saying so and checkpointing its last step."""

import json
import math
import os
import random

import pytest

from ballast.data.gsm8k import gsm8k_rows
from ballast.data.io import write_parquet
from ballast.trainer.config import load_config
from ballast.trainer.main import prepare_typed, training_session

from testkit.e2e import run_dir

# The score: an even answer scores 1 whatever the response (its group carries no signal and is filtered);
# an odd one scores the parity of the response's bytes (random under the untrained model).
SCORE_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2 == 0:
        return 1.0
    return float(sum(solution_str.encode()) % 2)
'''

TRAIN_ROWS, GEN_BATCH = 64, 8


def _records(count, seed):
    """GSM8K records; one in four has an odd answer. Questions of 0-14 filler words, so each generation
    batch is padded to its own prompt width."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        a = rng.randrange(1, 50)
        answer = 2 * a + (1 if i % 4 == 0 else 0)
        filler = " ".join(["please"] * rng.randrange(0, 15))
        records.append({"question": f"{filler} What is {answer - a} plus {a}?".strip(),
                        "answer": f"{answer - a} + {a} = {answer}\n#### {answer}"})
    return records


@pytest.fixture()
def gsm8k_task(tmp_path):
    train = write_parquet(gsm8k_rows(_records(TRAIN_ROWS, 0), split="train"), tmp_path / "gsm8k" / "train.parquet")
    test = write_parquet(gsm8k_rows(_records(8, 1), split="test"), tmp_path / "gsm8k" / "test.parquet")
    score = tmp_path / "score.py"
    score.write_text(SCORE_FN)
    return {"train": str(train), "val": str(test), "score": str(score)}


def _dapo_line(task, model, out_dir):
    """verl's DAPO recipe overrides (tests/unit/trainer/test_verl_examples.py), sizes scaled down."""
    return [
        f"data.train_files={task['train']}", f"data.val_files={task['val']}", "data.prompt_key=prompt",
        "data.truncation=left", f"data.gen_batch_size={GEN_BATCH}", "data.max_prompt_length=256",
        "data.max_response_length=24", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False", "algorithm.kl_ctrl.kl_coef=0.0",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.kl_loss_coef=0.0",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.clip_ratio_c=10.0", "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.max_num_gen_batches=10", "algorithm.filter_groups.metric=acc",
        "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=2048",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=2048", f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.lr_warmup_steps=1",
        "actor_rollout_ref.actor.optim.weight_decay=0.1", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.grad_clip=1.0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.top_p=1.0", "actor_rollout_ref.rollout.top_k=-1",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "actor_rollout_ref.rollout.val_kwargs.top_p=0.7",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True", "actor_rollout_ref.rollout.val_kwargs.n=1",
        "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
        "reward_model.overlong_buffer.len=8", "reward_model.overlong_buffer.penalty_factor=1.0",
        f"custom_reward_function.path={task['score']}", "trainer.logger=[jsonl]", "trainer.project_name=DAPO",
        "trainer.val_before_train=True", "trainer.test_freq=2", "trainer.save_freq=2", "trainer.total_epochs=1",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={out_dir}",
        # the CPU box: two worker processes, the HF rollout
        "trainer.device=cpu", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=hf",
    ]


def test_dapo_recipe_draws_several_generation_batches_and_stops_with_its_data(gsm8k_task, tiny_task, e2e_ray,
                                                                             tmp_path, capfd):
    out = run_dir(tmp_path, "dapo")
    with training_session(prepare_typed(load_config(_dapo_line(gsm8k_task, tiny_task["model"], out)))) as trainer:
        planned = trainer.total_steps
        trainer.fit()
        trained = trainer.global_step
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in rows if "train/num_gen_batches" in r]
    gen_batches = [r["train/num_gen_batches"] for r in steps]

    assert planned == TRAIN_ROWS // GEN_BATCH  # verl's count: total_epochs x generation batches per epoch
    assert [r["step"] for r in steps] == list(range(1, trained + 1)) and trained >= 2
    assert max(gen_batches) >= 2, gen_batches  # a step that drew more than one generation batch
    assert sum(r["training/filter_groups/evicted_samples"] for r in steps) > 0
    assert sum(gen_batches) <= planned  # never more than the one epoch of data
    assert trained < planned  # the data ran out before the planned step count, as in verl's recipe
    captured = capfd.readouterr()
    assert (f"ballast: the training data of trainer.total_epochs=1 is used up (1 x {planned} batches of {GEN_BATCH} "
            f"prompts)") in captured.out and f"training stops after step {trained} of the {planned} planned" in captured.out
    with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == trained  # the last step is checkpointed (save_freq=2 or the end of the data)

    for row in steps:  # acc (before the overlong penalty) is what the groups were filtered on
        assert 0.0 <= row["reward_extra/acc/mean"] <= 1.0 and math.isfinite(row["actor/pg_loss"])
        # the line names no rollout.calculate_log_probs: verl's default (true) gives the mismatch metrics
        assert math.isfinite(row["rollout_corr/k3_kl"]) and math.isfinite(row["training/rollout_actor_log_prob_diff/max"])
    validations = [r for r in rows if any(k.startswith("val-core/") for k in r)]
    assert validations and validations[0]["step"] == 0
    for row in validations:
        core = {k for k in row if k.startswith("val-core/")}
        assert core == {"val-core/openai/gsm8k/acc/mean@1"}, core  # verl's main variable with the DAPO manager
        assert "val-aux/openai/gsm8k/reward/mean@1" in row and "val-aux/openai/gsm8k/overlong/mean@1" not in row


def test_dapo_with_a_batch_generated_ahead_fills_each_step_with_fresh_samples(gsm8k_task, tiny_task, e2e_ray, tmp_path):
    # off-policy overlap, one batch ahead: each step's first generation batch is one update old (from
    # step 2 on); the further batches dynamic sampling needs are generated with the latest weights
    out = run_dir(tmp_path, "dapo_k1")
    line = _dapo_line(gsm8k_task, tiny_task["model"], out) + [
        "trainer.ballast_overlap.batches_ahead=1",
        "trainer.test_freq=-1", "trainer.val_before_train=False", "trainer.save_freq=2"]
    with training_session(prepare_typed(load_config(line))) as trainer:
        assert trainer.rollouts.ahead == 1 and trainer.correction.bypass
        trainer.fit()
        trained = trainer.global_step
    rows = [json.loads(r) for r in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in rows if "train/num_gen_batches" in r]
    assert [r["step"] for r in steps] == list(range(1, trained + 1)) and trained >= 3
    age = "training/off_policy/trajectory_staleness"
    assert steps[0][f"{age}/max"] == 0.0  # nothing was generated ahead of the first step
    refilled = [r for r in steps[1:] if r["train/num_gen_batches"] >= 2]
    assert refilled, [r["train/num_gen_batches"] for r in steps]
    for r in refilled:  # mixed ages: the ahead batch's groups (if any survived) and fresh ones
        assert r[f"{age}/min"] == 0.0 and r[f"{age}/max"] <= 1.0
    for r in steps[1:]:
        if r["train/num_gen_batches"] == 1:
            assert r[f"{age}/min"] == 1.0
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["rollout_corr/k3_kl"])
    # the run ends when the data runs out, with batches launched ahead: the last step is checkpointed
    with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == trained
