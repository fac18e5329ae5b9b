"""The reward model's driver side: the rows it reads (as generated, or rendered again in another
tokenizer and template), its forward's plan (token cap, equal micro-batch counts over DP ranks),
the combined reward, and the start-up refusals naming their key."""

import json
import os

import numpy as np
import pytest
import torch

from ballast.balance import MicroBatchMode, MicroBatchPolicy
from ballast.models import load_tokenizer, tiny_model_dir
from ballast.models.tokenizer import save_tokenizer, train_tokenizer
from ballast.protocol import Batch
from ballast.trainer.config.errors import ConfigError
from ballast.trainer.step.reward_model import CombinedReward, RewardModelScorer, RmInputs, render_conversation

OTHER_TEMPLATE = ("{%- for m in messages -%}{{- m['role'] | upper + ': ' + m['content'] + '\\n' -}}{%- endfor -%}"
                  "{%- if add_generation_prompt -%}{{- 'ASSISTANT: ' -}}{%- endif -%}")


@pytest.fixture(scope="module")
def policy_tokenizer():
    return load_tokenizer(tiny_model_dir())


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """A second byte-level BPE with another vocabulary and another chat template."""
    corpus = ["USER: Repeat the symbol # exactly 3 times.", "ASSISTANT: ###", "a b c d e f g"] * 20
    tok = train_tokenizer(corpus, vocab_size=300)
    tok.chat_template = OTHER_TEMPLATE
    path = tmp_path_factory.mktemp("other_tok")
    save_tokenizer(tok, path)
    return load_tokenizer(path)


def generated_batch(tokenizer, prompts, responses, response_width=12):
    """A batch as the rollout returns it: chat-templated prompts left-padded, responses (+eos) right-padded."""
    chats = [[{"role": "user", "content": p}] for p in prompts]
    p_ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]
    p_ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in p_ids]
    r_ids = [tokenizer(r, add_special_tokens=False)["input_ids"][:response_width - 1] + [tokenizer.eos_token_id]
             for r in responses]
    width = max(map(len, p_ids))
    n, pad = len(prompts), tokenizer.pad_token_id
    ids = torch.full((n, width + response_width), pad)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(p_ids, r_ids)):
        ids[i, width - len(p):width + len(r)] = torch.tensor(p + r)
        mask[i, width - len(p):width + len(r)] = 1
    return Batch({"input_ids": ids, "attention_mask": mask, "responses": ids[:, width:].clone(),
                  "response_mask": mask[:, width:].clone()},
                 {"raw_prompt": np.array(chats + [None], dtype=object)[:-1]})


def test_shared_tokenizer_reads_the_generated_tokens_and_scores_at_the_last(policy_tokenizer):
    batch = generated_batch(policy_tokenizer, ["Repeat the symbol # exactly 3 times.", "Hi"], ["###", "@@@@@@@"])
    rows, cut = RmInputs(policy_tokenizer, policy_tokenizer, max_length=64)(batch)
    assert not cut.any()
    for i in range(2):
        conv = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        width = rows["input_ids"].shape[1] - 1
        assert rows["input_ids"][i, width - len(conv):width].tolist() == conv  # unchanged, left-padded
        assert int(rows["attention_mask"][i].sum()) == len(conv) + 1  # + the placeholder
    assert rows["responses"].shape[1] == 1 and rows["response_mask"].eq(1).all()


def test_other_tokenizer_and_template_render_the_conversation_again(policy_tokenizer, other_tokenizer):
    prompts, answers = ["Repeat the symbol # exactly 3 times.", "Repeat the symbol @ exactly 1 times."], ["###", "@"]
    batch = generated_batch(policy_tokenizer, prompts, answers)
    inputs = RmInputs(policy_tokenizer, other_tokenizer, max_length=200)
    assert inputs.rerender
    rows, cut = inputs(batch)
    assert not cut.any()
    for i, (p, a) in enumerate(zip(prompts, answers)):
        got = rows["input_ids"][i][rows["attention_mask"][i].bool()].tolist()[:-1]  # drop the placeholder
        want = f"USER: {p}\nASSISTANT: {a}\n"  # the RM's template, the policy's eos dropped
        assert other_tokenizer.decode(got) == want
        assert got == other_tokenizer(want, add_special_tokens=False)["input_ids"]
        assert got != batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
    assert render_conversation(other_tokenizer, [{"role": "user", "content": "q"}], "a") == "USER: q\nASSISTANT: a\n"


def test_a_conversation_past_max_length_keeps_its_end_and_is_recorded(policy_tokenizer):
    batch = generated_batch(policy_tokenizer, ["Repeat the symbol # exactly 3 times.", "Hi"], ["###", "#"])
    lengths = batch["attention_mask"].sum(-1).tolist()
    limit = min(lengths) + 1
    rows, cut = RmInputs(policy_tokenizer, policy_tokenizer, max_length=limit)(batch)
    assert cut.tolist() == [n > limit for n in lengths]
    long = int(np.argmax(lengths))
    conv = batch["input_ids"][long][batch["attention_mask"][long].bool()].tolist()
    assert rows["input_ids"][long][rows["attention_mask"][long].bool()].tolist()[:-1] == conv[-limit:]


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("dynamic", [True, False])
def test_the_forward_plan_keeps_the_cap_and_equal_counts_over_ranks(dp, dynamic):
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 90, size=37)
    mask = torch.zeros(len(lengths), 91, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, 91 - n:] = 1
    rows = Batch({"attention_mask": mask})[: len(lengths) // dp * dp]
    lengths = lengths[: len(rows)]
    budget = 128
    policy = (MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=budget) if dynamic
              else MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=3))
    plan = RewardModelScorer(None, None, dp, policy).plan(rows)
    mb = plan.mini_batches[0]
    assert mb.dp_size == dp and len({len(r) for r in mb.micro_batches}) == 1  # equal counts
    seen = []
    for r in range(dp):
        rank_rows = plan.rank_rows(r)
        for micro in mb.for_rank(r):
            tokens = int(lengths[rank_rows[micro]].sum())
            if dynamic:
                assert tokens <= budget
            else:
                assert len(micro) <= 3
            seen.extend(rank_rows[micro].tolist())
    assert sorted(seen) == list(range(len(lengths)))
    assert sorted(plan.rows[plan.restore_index()].tolist()) == list(range(len(lengths)))


class _Rule:
    def __call__(self, batch, step=None):
        scores = torch.zeros(batch["responses"].shape)
        scores[:, 1] = torch.tensor([0.5, 1.0])
        return scores, {"acc": np.array([0.0, 1.0])}


class _Scorer:
    def __call__(self, batch):
        return np.array([2.0, -4.0]), np.array([False, True])


def test_combined_reward_weights_the_parts_on_the_last_sampled_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = Batch({"responses": torch.zeros(2, 3, dtype=torch.long), "response_mask": mask})
    scores, extras = CombinedReward(_Rule(), _Scorer(), score_weight=0.5, rule_weight=2.0)(batch)
    assert scores.sum(-1).tolist() == [2 * 0.5 + 0.5 * 2.0, 2 * 1.0 + 0.5 * -4.0]
    assert scores[0, 1] == 2.0 and scores[1, 2] == -2.0  # the RM score on each row's last sampled token
    assert extras["rule_score"].tolist() == [0.5, 1.0] and extras["rm_score"].tolist() == [2.0, -4.0]
    assert extras["rm_truncated"].tolist() == [0.0, 1.0] and extras["acc"].tolist() == [0.0, 1.0]


# ---------------------------------------------------------------- start-up refusals


def _cfg(tmp_path, model_path, *extra):
    from ballast.trainer.config import load_config

    return load_config([f"actor_rollout_ref.model.path={tiny_model_dir()}", "data.train_files=x.parquet",
                        f"trainer.default_local_dir={tmp_path}", "reward.reward_model.enable=True",
                        f"reward.reward_model.model_path={model_path}", "data.max_prompt_length=32",
                        "data.max_response_length=24", *extra])


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from ballast.models.reward_model import save_reward_model

    path = tmp_path_factory.mktemp("rm")
    save_reward_model(tiny_model_dir(), path)
    return str(path)


def _check(cfg, tokenizer):
    from ballast.trainer.run.reward_model import check_reward_model, reward_model_run

    run = reward_model_run(cfg, world_size=2, max_seq_len=56)
    return check_reward_model(cfg, run.sizes, tokenizer)


def test_legacy_keys_move_to_the_reward_section(tmp_path, rm_dir):
    cfg = _cfg(tmp_path, "unused", f"reward_model.model.path={rm_dir}", "reward_model.enable_resource_pool=True",
               "reward_model.nnodes=1", "reward_model.n_gpus_per_node=1")
    rm = cfg.reward.reward_model
    assert (rm.model_path, rm.enable_resource_pool, rm.nnodes, rm.n_gpus_per_node) == (rm_dir, True, 1, 1)


def test_a_causal_lm_is_refused_naming_the_key(tmp_path, policy_tokenizer):
    with pytest.raises(ConfigError, match=r"reward\.reward_model\.model_path.*not a sequence classifier"):
        _check(_cfg(tmp_path, tiny_model_dir()), policy_tokenizer)


def test_a_max_length_under_the_longest_conversation_is_refused(tmp_path, rm_dir, policy_tokenizer):
    with pytest.raises(ConfigError, match=r"reward\.reward_model\.max_length=40 is shorter.* = 56"):
        _check(_cfg(tmp_path, rm_dir, "reward.reward_model.max_length=40"), policy_tokenizer)
    assert _check(_cfg(tmp_path, rm_dir), policy_tokenizer) is not None


def test_a_template_rendering_nothing_is_refused(tmp_path, rm_dir, policy_tokenizer, other_tokenizer):
    empty = os.path.join(str(tmp_path), "rm_empty")
    os.makedirs(empty)
    for name in os.listdir(rm_dir):
        if name not in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            os.link(os.path.join(rm_dir, name), os.path.join(empty, name))
    other_tokenizer.chat_template = "{{- '' -}}"
    other_tokenizer.save_pretrained(empty)
    with pytest.raises(ConfigError, match=r"reward\.reward_model\.model_path=.*renders a two-message chat as no tokens"):
        _check(_cfg(tmp_path, empty), policy_tokenizer)


def test_a_pool_of_its_own_needs_nodes(tmp_path, rm_dir):
    from ballast.trainer.run.reward_model import reward_model_run

    cfg = _cfg(tmp_path, rm_dir, "reward.reward_model.enable_resource_pool=True")
    with pytest.raises(ConfigError, match=r"reward\.reward_model\.nnodes >= 1"):
        reward_model_run(cfg, world_size=2, max_seq_len=56)
    sizes = reward_model_run(_cfg(tmp_path, rm_dir, "reward.reward_model.enable_resource_pool=True",
                                  "reward.reward_model.nnodes=1", "reward.reward_model.n_gpus_per_node=3"),
                             world_size=2, max_seq_len=56).sizes
    assert sizes.own_pool and sizes.dp_size == 3
    assert json.load(open(os.path.join(rm_dir, "config.json")))["architectures"] == ["Qwen2ForSequenceClassification"]


class _LengthGroup:
    """A worker group stand-in answering each row's token count as its score, in dispatch order."""

    def __init__(self):
        self.sizes = []

    def compute_rm_scores(self, rows, plan):
        self.sizes.append(len(rows))
        return Batch({"values": rows["attention_mask"].sum(-1, keepdim=True).float()})


def test_a_batch_not_dividing_over_the_ranks_is_filled_and_scores_come_back_in_row_order(policy_tokenizer):
    batch = generated_batch(policy_tokenizer, ["a", "bb bb", "Repeat the symbol # exactly 3 times."], ["#", "##", "#"])
    group = _LengthGroup()
    scorer = RewardModelScorer(RmInputs(policy_tokenizer, policy_tokenizer, 64), group, 2,
                               MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=64))
    scores, _ = scorer(batch)
    assert group.sizes == [4]  # one copy of the shortest row fills the second rank
    assert scores.tolist() == (batch["attention_mask"].sum(-1) + 1).tolist()
