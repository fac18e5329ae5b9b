"""What a score function receives after agent-loop rollouts: scripted tool conversations (a tool
that returns a reward, one that returns plain text, refused calls) go through the rollout output
(`assemble`, `sample_columns`) and the reward manager; the score function's extra_info holds the
dataset row's keys and verl's `num_turns`, `tool_rewards`, `turn_scores`, `rollout_reward_scores`.
Tool rewards reach the score only through extra_info, as in verl."""

import asyncio
import json
import logging

import numpy as np
import torch

from ballast.protocol import Batch
from ballast.tools import CalculatorTool, Tool
from ballast.trainer.step.reward import RewardManager
from ballast.workers.agent_loop import AgentSample, ChatFormat, ToolAgentLoop
from ballast.workers.agent_loop.output import assemble, sample_columns
from testkit.agent import ScriptedEngine, make_context


class ScorerTool(Tool):
    """Answers "got x" with the step reward x / 4 (verl's (response, reward, metrics) tuple)."""

    default_schema = {"type": "function", "function": {
        "name": "scorer", "description": "Score x.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}

    async def execute(self, instance_id, parameters, **kwargs):
        return f"got {parameters['x']}", parameters["x"] / 4, {}


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


SCRIPTS = {  # turns of each conversation; the expected tool_rewards and num_turns
    "a": ([call("scorer", x=2), "done"], [0.5], 4),
    "b": (["Hi!"], [], 2),
    # a reward, an unknown tool; then a tool without a reward and invalid arguments: 0.0 each
    "c": ([call("scorer", x=1) + call("nosuch"), call("calculator", expression="6 * 7") + call("scorer", x="s"),
           "end"], [0.25, 0.0, 0.0, 0.0], 6),
}


def play(tokenizer):
    keys = sorted(SCRIPTS)
    messages = {k: [{"role": "user", "content": f"Question {k}?"}] for k in keys}
    chat = ChatFormat(tokenizer)
    prompts = {k: chat.prompt_ids(messages[k]) for k in keys}
    key_of = lambda ids: next(k for k in keys if list(ids[: len(prompts[k])]) == prompts[k])
    engine = ScriptedEngine(tokenizer, {k: s[0] for k, s in SCRIPTS.items()}, key_of, tokenizer.eos_token_id)
    ctx = make_context(engine, tokenizer, {"scorer": ScorerTool(), "calculator": CalculatorTool()},
                       max_parallel_calls=2)
    loop = ToolAgentLoop(ctx)

    async def main():
        return await asyncio.gather(*(loop.run(AgentSample(i, prompts[k], messages[k])) for i, k in enumerate(keys)))

    outputs = asyncio.run(main())
    width = max(len(p) for p in prompts.values())
    ids = torch.zeros((len(keys), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, k in enumerate(keys):
        ids[i, width - len(prompts[k]):], mask[i, width - len(prompts[k]):] = torch.tensor(prompts[k]), 1
    tensors = assemble(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), outputs, pad_token_id=0,
                       prompt_length=width, response_length=None, with_log_probs=True)
    return keys, outputs, sample_columns(outputs, ["tool_agent"] * len(keys)), tensors


def rows_of(keys, extra):
    column = np.empty(len(keys), dtype=object)
    for i, key in enumerate(keys):
        column[i] = {"index": i, "question": key, **extra}
    return column


def score_all(tokenizer, tensors, non_tensors):
    seen = []

    def score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return sum(extra_info["tool_rewards"])

    n = len(next(iter(non_tensors.values())))
    reward_model = np.empty(n, dtype=object)
    reward_model[:] = [{"ground_truth": "x"} for _ in range(n)]
    batch = Batch(dict(tensors.items()), {"data_source": np.array(["src"] * n, dtype=object),
                                          "reward_model": reward_model, **non_tensors})
    scores, _ = RewardManager(tokenizer, score)(batch)
    return seen, scores


def test_the_score_function_gets_each_conversations_turns_and_tool_rewards(tiny_tokenizer):
    keys, outputs, columns, tensors = play(tiny_tokenizer)
    for key, out in zip(keys, outputs):
        assert out.tool_rewards == SCRIPTS[key][1] and out.num_turns == SCRIPTS[key][2], key
        assert out.info["tool_calls"] == len(out.tool_rewards)
    assert "agent_tool_reward" not in columns  # the old per-sample sum, which nothing read
    seen, scores = score_all(tiny_tokenizer, tensors, {"extra_info": rows_of(keys, {"split": "train"}), **columns})
    for i, (key, info) in enumerate(zip(keys, seen)):
        _, rewards, turns = SCRIPTS[key]
        assert info == {"index": i, "question": key, "split": "train", "num_turns": turns, "tool_rewards": rewards,
                        "turn_scores": [], "rollout_reward_scores": {}}, key
        assert type(info["num_turns"]) is int and all(type(r) is float for r in info["tool_rewards"])
    # the reward is what the score function returned: tool rewards are not added on top (verl)
    assert scores.sum(-1).tolist() == [0.5, 0.0, 0.25]


def test_batched_rollouts_are_single_answers_and_a_clash_keeps_the_rollouts_value(tiny_tokenizer, caplog):
    keys, _, columns, tensors = play(tiny_tokenizer)
    rows = rows_of(keys, {"num_turns": "from the dataset"})
    with caplog.at_level(logging.WARNING, logger="ballast.trainer.step.reward"):
        seen, _ = score_all(tiny_tokenizer, tensors, {"extra_info": rows})  # no agent columns: batched rollouts
    assert [info["num_turns"] for info in seen] == [2, 2, 2]
    assert all(info["tool_rewards"] == [] and info["turn_scores"] == [] for info in seen)
    assert [r["num_turns"] for r in rows] == ["from the dataset"] * 3  # the rows' dicts are unchanged
    clashes = [r.getMessage() for r in caplog.records if "num_turns" in r.getMessage()]
    assert len(clashes) == 1 and "extra_info['num_turns'] is replaced by the rollout's" in clashes[0]
    seen, _ = score_all(tiny_tokenizer, tensors, {"extra_info": rows, **columns})
    assert [info["num_turns"] for info in seen] == [SCRIPTS[k][2] for k in keys]
