"""A reward model in the reward path: each conversation scored by a sequence classifier, the score
combined with the rule/function reward and placed on the response's last sampled token (where the
rule score goes, so every estimator sees it under the response mask).

`RmInputs` builds the rows the reward model reads. With the policy's own tokenizer and chat template
the conversation's tokens are used as generated. Otherwise (another vocabulary or another template)
the response is decoded with the policy's tokenizer (special tokens dropped) and the chat, the
dataset's `raw_prompt` plus the response as the assistant's message, is rendered again with the
reward model's template and tokenized with its tokenizer, as verl does for an RM with its own
tokenizer. A conversation longer than the reward model's `max_length` keeps its last `max_length`
tokens (the answer is at the end) and is recorded per sample as `rm_truncated`; with a shared
tokenizer the start-up check refuses a `max_length` that the longest conversation could exceed, so
there this never happens.

`RewardModelScorer` plans the forward as every forward-only phase is planned (`plan_phase`: balanced
over the reward model's DP ranks, the role's static or token-budget micro-batches) and runs it on the
resident reward-model workers. `CombinedReward` is what the trainer calls in place of the rule
`RewardManager`: `rule_weight * rule score + score_weight * RM score`, each part kept per sample as
`rule_score` and `rm_score` (logged as `reward_extra/*`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from ballast.balance import MicroBatchPolicy, plan_phase
from ballast.protocol import Batch
from ballast.trainer.step.reward import _last_sampled


def same_text_format(policy_tokenizer, rm_tokenizer) -> bool:
    """Whether the reward model reads the policy's tokens as they are: one vocabulary, one template."""
    return (policy_tokenizer.get_vocab() == rm_tokenizer.get_vocab()
            and policy_tokenizer.chat_template == rm_tokenizer.chat_template)


def render_conversation(rm_tokenizer, prompt_messages, response_text: str) -> str:
    """The chat (prompt messages, then the response as the assistant's turn) in the reward model's
    template, without a leading bos (the tokenizer adds its own where it does)."""
    chat = [*list(prompt_messages), {"role": "assistant", "content": response_text}]
    text = rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    bos = rm_tokenizer.bos_token
    return text[len(bos):] if bos and text.startswith(bos) else text


@dataclass
class RmInputs:
    """Turns a generated batch into reward-model rows (module docstring)."""

    policy_tokenizer: object
    rm_tokenizer: object
    max_length: int

    def __post_init__(self) -> None:
        self.rerender = not same_text_format(self.policy_tokenizer, self.rm_tokenizer)
        tok = self.rm_tokenizer
        self.placeholder_id = tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.placeholder_id
        if self.placeholder_id is None:
            raise ValueError("the reward model's tokenizer has neither an eos nor a pad token")

    def token_lists(self, batch: Batch) -> list:
        """Each row's conversation in the reward model's tokens (before any cut)."""
        width = batch["responses"].shape[1]
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        if not self.rerender:
            return [ids[i][mask[i]].tolist() for i in range(len(batch))]
        out = []
        for i in range(len(batch)):
            response = batch["responses"][i][mask[i, -width:]].tolist()
            text = self.policy_tokenizer.decode(response, skip_special_tokens=True)
            rendered = render_conversation(self.rm_tokenizer, batch["raw_prompt"][i], text)
            out.append(self.rm_tokenizer(rendered, add_special_tokens=False)["input_ids"])
        return out

    def __call__(self, batch: Batch) -> Tuple[Batch, np.ndarray]:
        """(rows in the engine's layout: the conversation left-padded in the prompt columns, one
        placeholder response token; whether each row was cut to `max_length`)."""
        lists = self.token_lists(batch)
        truncated = np.array([len(t) > self.max_length for t in lists])
        lists = [t[-self.max_length:] for t in lists]
        if any(len(t) == 0 for t in lists):
            raise ValueError("a conversation rendered for the reward model is empty")
        width = max(len(t) for t in lists)
        n = len(lists)
        input_ids = torch.full((n, width + 1), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, width + 1), dtype=torch.long)
        for i, t in enumerate(lists):
            input_ids[i, width - len(t):width] = torch.tensor(t, dtype=torch.long)
            attention[i, width - len(t):] = 1
        input_ids[:, width] = self.placeholder_id
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        rows = Batch({"input_ids": input_ids, "attention_mask": attention, "position_ids": position_ids,
                      "responses": input_ids[:, width:].clone(), "response_mask": attention[:, width:].clone()})
        return rows, truncated


class RewardModelScorer:
    """Scores batches on the reward-model worker group `group` (its `compute_rm_scores`), planned over
    `dp_size` ranks with `policy`; `balance`/`workload` as `trainer.balance_batch`/`balance_workload`."""

    def __init__(self, inputs: RmInputs, group, dp_size: int, policy: MicroBatchPolicy, balance: bool = True,
                 workload="tokens") -> None:
        self.inputs, self.group, self.dp_size, self.policy = inputs, group, dp_size, policy
        self.balance, self.workload = balance, workload

    def plan(self, rows: Batch):
        return plan_phase(rows["attention_mask"].sum(-1).numpy(), self.dp_size, self.policy, balance=self.balance,
                          workload=self.workload)

    def __call__(self, batch: Batch) -> Tuple[np.ndarray, np.ndarray]:
        """(score of each row, whether its conversation was cut), in row order. A batch that does not
        divide over the ranks (validation's) is filled up with copies of its shortest row, whose
        scores are dropped."""
        rows, truncated = self.inputs(batch)
        n = len(rows)
        fill = -n % self.dp_size
        if fill:
            shortest = int(rows["attention_mask"].sum(-1).argmin())
            rows = Batch.concat([rows, rows[np.full(fill, shortest)]])
        plan = self.plan(rows)
        out = self.group.compute_rm_scores(rows[plan.rows], plan)
        scores = out["values"][:, 0][torch.as_tensor(plan.restore_index())][:n]
        return scores.double().numpy(), truncated


class CombinedReward:
    """The rule reward and the reward model's score, combined per sample (module docstring)."""

    def __init__(self, rule, scorer: RewardModelScorer, score_weight: float, rule_weight: float) -> None:
        self.rule, self.scorer = rule, scorer
        self.score_weight, self.rule_weight = float(score_weight), float(rule_weight)
        self._busy = threading.Lock()  # a batch scored ahead and validation may meet

    def __call__(self, batch: Batch, step: Optional[int] = None) -> Tuple[torch.Tensor, Dict[str, np.ndarray]]:
        with self._busy:
            rule_scores, extras = self.rule(batch, step=step)
            rm, truncated = self.scorer(batch)
        last = torch.as_tensor(_last_sampled(batch["response_mask"]))
        scores = rule_scores * self.rule_weight
        has = last >= 0
        rows = torch.arange(len(batch))[has]
        scores[rows, last[has]] += torch.as_tensor(rm, dtype=torch.float32)[has] * self.score_weight
        extras = dict(extras)
        extras["rule_score"] = rule_scores.sum(-1).double().numpy()
        extras["rm_score"] = rm
        extras["rm_truncated"] = truncated.astype(np.float64)
        return scores, extras
