"""GRPO through the trainer with the actor cut into a pipeline of two stages (pp=2 on the two workers,
so dp=1), against the e2e tests' shared plain run (pp=1, dp=2) of the same config: per-step metrics
to float rounding (training, the forward-only old-log-prob pass over the second mini-batch, the
weight sync that gathers both stages for the rollout), the bubble metrics, the step-2 HF export;
then an exact resume from the pipeline's own checkpoint, whose reference (a pipeline too) gives the
start model's log-probs; and a resume under other pipeline sizes refused before any worker starts."""

import glob
import json
import os
import shutil

import pytest
import torch

from testkit.e2e import WITH_ROLLOUT_LOG_PROBS, overrides, run_dir

PP2 = ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",)
THREE_STEPS = (*WITH_ROLLOUT_LOG_PROBS, "trainer.total_training_steps=3", "trainer.save_freq=2")
SAME = ["critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/ppo_kl",
        "actor/entropy", "actor/pg_clipfrac", "critic/advantages/max"]


@pytest.fixture(scope="module")
def pipeline_run(tiny_task, e2e_ray, tmp_path_factory):
    """The shared run's config (three steps, checkpoints at steps 2 and 3) with the actor at pp=2."""
    from ballast.trainer.config import load_config
    from ballast.trainer.main import prepare_typed, training_session

    path = run_dir(tmp_path_factory.mktemp("pipeline"), "pp2")
    with training_session(prepare_typed(load_config(overrides(tiny_task, path, *THREE_STEPS, *PP2)))) as trainer:
        mode = trainer.old_log_probs.mode
        trainer.fit()
        fingerprint = trainer.workers.actor_rollout.actor_state_fingerprint()[0]
    with open(os.path.join(path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {"mode": mode, "rows": rows, "fingerprint": fingerprint, "dir": path}


def _weights(export_dir):
    from safetensors.torch import load_file

    out = {}
    for file in glob.glob(os.path.join(export_dir, "*.safetensors")):
        out.update(load_file(file))
    return out


def test_a_pipeline_actor_trains_like_the_plain_one(pipeline_run, rollout_log_probs_run):
    assert pipeline_run["mode"] == "partial"  # the second mini-batch's old log-probs: a forward-only pipeline pass
    plain, piped = rollout_log_probs_run["rows"], pipeline_run["rows"]
    assert [r["step"] for r in piped] == [r["step"] for r in plain] == [1, 2, 3]
    for a, b in zip(plain, piped):
        for key in SAME:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (b["step"], key)
        # steps 2 and 3 sampled from the weights the sync gathered from both stages
        assert b["training/rollout_actor_log_prob_diff/max"] < 1e-3
        assert 0.0 <= b["perf/pp_bubble_fraction"] < 1.0 and 0.0 < b["perf/pp_bubble_fraction_predicted"] < 1.0
        assert b["balance/actor_plan/pp_num_micro_batches_min"] >= 2  # at least one micro-batch per stage
        assert b["perf/micro_batch_tokens/max"] <= 128  # the hard token cap: the slot
        assert "perf/pp_bubble_fraction" not in a
    assert pipeline_run["fingerprint"] == pytest.approx(rollout_log_probs_run["fingerprint"], rel=1e-6)
    step2 = os.path.join(pipeline_run["dir"], "global_step_2")
    with open(os.path.join(step2, "actor", "pipeline.json")) as f:
        assert json.load(f)["pipeline_model_parallel_size"] == 2
    exported = _weights(os.path.join(step2, "actor_hf"))
    reference = _weights(os.path.join(rollout_log_probs_run["dir"], "global_step_2", "actor_hf"))
    assert sorted(exported) == sorted(reference)
    assert max(float((exported[k] - reference[k]).abs().max()) for k in reference) < 1e-4


def _resumable(pipeline_run, tmp_path, name):
    """A run directory holding a copy of the pipeline run's step-2 checkpoint, marked as the latest."""
    root = os.path.join(tmp_path, name)
    shutil.copytree(os.path.join(pipeline_run["dir"], "global_step_2"), os.path.join(root, "global_step_2"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    return root


def test_a_pipeline_run_resumes_exactly_and_its_reference_is_the_start_model(session, pipeline_run, tmp_path,
                                                                              tiny_task):
    from transformers import AutoModelForCausalLM

    from testkit.engine import reference_log_probs

    _resumable(pipeline_run, tmp_path, "resumed")
    # the reference at pp=2 as well (the actor's sizes by default); kl_loss_coef=0 leaves the loss as it was
    kl = ("actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.0")
    seen = []
    with session("resumed", *THREE_STEPS, *PP2, *kl, "trainer.resume_mode=auto") as trainer:
        assert trainer.global_step == 2
        compute_ref = trainer.workers.actor_rollout.compute_ref_log_prob

        def recorded(batch, plan):  # what the driver sends the reference, and what comes back
            out = compute_ref(batch, plan)
            seen.append((batch, out))
            return out

        trainer.workers.actor_rollout.compute_ref_log_prob = recorded
        resumed = trainer.fit()
    straight = pipeline_run["rows"][-1]
    for key in SAME:
        assert resumed[key] == pytest.approx(straight[key], rel=1e-6, abs=1e-7), key
    assert resumed["actor/kl_loss"] > 0  # step 3's actor has moved away from the start model
    [(batch, out)] = seen  # one step: step 3
    start = AutoModelForCausalLM.from_pretrained(tiny_task["model"], dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        expected, _ = reference_log_probs(start, batch.tensors)
    mask = batch["response_mask"].bool()
    assert float((out["ref_log_prob"] - expected)[mask].abs().max()) < 1e-4


def test_a_resume_under_other_pipeline_sizes_is_refused_before_any_worker_starts(session, pipeline_run, tmp_path):
    from ballast.trainer.run.checkpoints import CheckpointError

    _resumable(pipeline_run, tmp_path, "other_sizes")
    with pytest.raises(CheckpointError, match=r"actor_rollout_ref\.actor\.megatron\.pipeline_model_parallel_size=2.*"
                                              r"this run has 1 and 1.*actor_hf"):
        with session("other_sizes", *THREE_STEPS, "trainer.resume_mode=auto"):
            pass
    assert not os.path.exists(os.path.join(tmp_path, "other_sizes", "workers.json"))  # no worker was started
