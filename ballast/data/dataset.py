"""Prompt dataset for RL (verl's RLHFDataset role): rows from parquet/JSONL files -> chat-templated,
tokenized prompts, plus the fields the reward needs, and a left-padding collate function.

All rows are validated and tokenized when the dataset is built, so a bad file fails at start-up
(naming file, row and field) rather than in the middle of a run, and `len(dataset)` is final (prompts
dropped by ``truncation="filter"`` are already gone).

Row format (verl): ``prompt`` (list of ``{"role", "content"}`` messages; a non-empty string is taken
as one user message), ``data_source`` (str), ``reward_model`` (dict with ``ground_truth``), optional
``extra_info`` (dict; ``extra_info["index"]`` is the sample's index, else its row number) and
``ability`` and ``agent_name`` (the agent loop that plays the row; None: the configured default). Row numbers in errors are 0-based within their file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import torch

from ballast.data.errors import SettingError
from ballast.data.io import read_rows

logger = logging.getLogger(__name__)

Truncation = Literal["error", "left", "right", "middle", "filter"]
TRUNCATION_MODES: tuple[str, ...] = get_args(Truncation)
NON_TENSOR_KEYS = ("data_source", "reward_model", "ground_truth", "extra_info", "index", "ability", "raw_prompt",
                   "agent_name")


@dataclass(frozen=True)
class DatasetStats:
    """What loading did: rows read, kept, dropped as too long, truncated, and prompt token lengths."""

    num_rows_read: int
    num_kept: int
    num_filtered: int
    num_truncated: int
    max_prompt_tokens_seen: int


class RLDataset(torch.utils.data.Dataset):
    """Tokenized prompts from one or more verl-format parquet/JSONL files.

    Args:
        files: a path or a list of paths (``.parquet``, ``.jsonl``/``.json`` lines).
        tokenizer: a Hugging Face tokenizer with a chat template (see `ballast.models.load_tokenizer`).
        max_prompt_length: longest prompt in tokens, after the chat template.
        truncation: what to do with a longer prompt: "error" (ValueError naming it), "left" (keep
            the last tokens), "right" (keep the first tokens), "middle" (keep the first half and the last
            half, as verl: floor(max/2) from the start, the rest from the end) or "filter" (drop it;
            counted and logged).
        prompt_key: the column holding the chat messages.
        chat_template_kwargs: extra keyword arguments for ``apply_chat_template``.
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer,
        *,
        max_prompt_length: int = 1024,
        truncation: Truncation = "error",
        prompt_key: str = "prompt",
        chat_template_kwargs: dict | None = None,
    ):
        if truncation not in TRUNCATION_MODES:
            raise SettingError("truncation", f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if not isinstance(max_prompt_length, int) or max_prompt_length < 1:
            raise SettingError("max_prompt_length", f"max_prompt_length must be a positive int, got {max_prompt_length!r}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; prompts are chat messages and need one")
        paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        if not paths:
            raise ValueError("no data files given")
        self.files = [Path(p) for p in paths]
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.prompt_key = prompt_key
        self._template_kwargs = dict(chat_template_kwargs or {})
        self._samples: list[dict] = []
        self.agent_names: dict[str, str] = {}
        """Each `agent_name` the rows name, with the first row naming it ("'<file>' row <i>"): the trainer
        checks them against the registered agent loops at start-up."""
        self._cut_generation_prompt = ""  # what right truncation removed from the prompts' end, if any
        read = filtered = truncated = longest = 0
        for path in self.files:
            rows = read_rows(path)
            read += len(rows)
            counts = self._add_file(path, rows, tokenizer)
            filtered, truncated, longest = filtered + counts[0], truncated + counts[1], max(longest, counts[2])
        self.stats = DatasetStats(read, len(self._samples), filtered, truncated, longest)
        self._log_stats()
        if not self._samples:
            why = (f"all {read} prompts are longer than max_prompt_length={max_prompt_length} (truncation='filter')"
                   if filtered else "the file(s) hold no rows")
            raise ValueError(f"no prompts in data file(s) {[str(p) for p in self.files]}: {why}")

    def _add_file(self, path: Path, rows: list[dict], tokenizer) -> tuple[int, int, int]:
        """Validate, template and tokenize one file's rows; returns (filtered, truncated, longest)."""
        parsed = [_parse_row(row, path, i, self.prompt_key) for i, row in enumerate(rows)]
        for i, item in enumerate(parsed):
            if item["agent_name"] is not None:
                self.agent_names.setdefault(item["agent_name"], _where(path, i))
        texts = []
        for i, item in enumerate(parsed):
            try:
                texts.append(
                    tokenizer.apply_chat_template(
                        item["raw_prompt"], add_generation_prompt=True, tokenize=False, **self._template_kwargs
                    )
                )
            except Exception as err:  # jinja/template errors of many types; name the row
                raise ValueError(f"{_where(path, i)}: applying the chat template failed: {err}") from err
        encoded = tokenizer(texts, add_special_tokens=False) if texts else {"input_ids": [], "attention_mask": []}
        filtered = truncated = longest = 0
        for i, (item, ids, mask) in enumerate(zip(parsed, encoded["input_ids"], encoded["attention_mask"])):
            check_tokenization(ids, mask, where=_where(path, i), vocab_size=len(tokenizer))
            longest = max(longest, len(ids))
            if len(ids) > self.max_prompt_length:
                if self.truncation == "error":
                    raise ValueError(
                        f"{_where(path, i)}: prompt has {len(ids)} tokens > max_prompt_length="
                        f"{self.max_prompt_length} (set truncation to 'filter', 'left' or 'right')"
                    )
                if self.truncation == "filter":
                    filtered += 1
                    continue
                keep = self.max_prompt_length
                if self.truncation == "middle":
                    ids = ids[:keep // 2] + ids[len(ids) - (keep - keep // 2):]
                else:
                    ids = ids[-keep:] if self.truncation == "left" else ids[:keep]
                truncated += 1
                if self.truncation == "right" and not self._cut_generation_prompt:
                    self._cut_generation_prompt = self._generation_prompt(tokenizer, item["raw_prompt"])
            item["input_ids"] = torch.tensor(ids, dtype=torch.long)
            self._samples.append(item)
        return filtered, truncated, longest

    def _generation_prompt(self, tokenizer, messages) -> str:
        """The text the chat template appends for the assistant's turn (add_generation_prompt); it sits
        at the very end of every prompt, so right truncation always cuts it."""
        try:
            with_turn = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                      **self._template_kwargs)
            without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False,
                                                    **self._template_kwargs)
        except Exception:  # the template rendered once already; a second failure only loses the warning
            return ""
        return with_turn[len(without):] if with_turn.startswith(without) else with_turn[-16:]

    def _log_stats(self) -> None:
        s = self.stats
        if self._cut_generation_prompt:
            logger.warning(
                "RLDataset: truncation='right' cut the end of %d prompt(s) longer than max_prompt_length=%d, "
                "and with it the chat template's generation prompt %r: the model will continue the user's "
                "text instead of answering. Use truncation='left' or 'filter', or raise max_prompt_length",
                s.num_truncated, self.max_prompt_length, self._cut_generation_prompt,
            )
        logger.info(
            "RLDataset: %d rows from %d file(s), kept %d, filtered %d and truncated %d prompts longer than "
            "max_prompt_length=%d (truncation=%s); longest prompt %d tokens",
            s.num_rows_read, len(self.files), s.num_kept, s.num_filtered, s.num_truncated,
            self.max_prompt_length, self.truncation, s.max_prompt_tokens_seen,
        )
        if s.num_filtered:
            logger.warning(
                "RLDataset: dropped %d of %d prompts longer than max_prompt_length=%d",
                s.num_filtered, s.num_rows_read, self.max_prompt_length,
            )

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def data_sources(self) -> set[str]:
        """The distinct `data_source` values of the rows (what the reward must be able to score)."""
        return {sample["data_source"] for sample in self._samples}

    def __getitem__(self, i: int) -> dict:
        return self._samples[i]


def _where(path: Path, row: int) -> str:
    return f"data file {str(path)!r} row {row}"


def _parse_row(row: dict, path: Path, i: int, prompt_key: str) -> dict:
    """The validated fields of one row; a ValueError names file, row and field otherwise."""
    where = _where(path, i)
    messages = _parse_prompt(row.get(prompt_key), where, prompt_key)
    data_source = row.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise ValueError(f"{where}: field 'data_source' must be a non-empty string, got {data_source!r}")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise ValueError(f"{where}: field 'reward_model.ground_truth' is missing (reward_model={reward_model!r})")
    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        raise ValueError(f"{where}: field 'extra_info' must be a dict, got {type(extra_info).__name__}")
    agent_name = row.get("agent_name")
    if isinstance(agent_name, float) and agent_name != agent_name:  # a missing cell read as NaN
        agent_name = None
    if agent_name is not None and (not isinstance(agent_name, str) or not agent_name):
        raise ValueError(f"{where}: field 'agent_name' must be a non-empty string or absent, got {agent_name!r}")
    return {
        "agent_name": agent_name,
        "raw_prompt": messages,
        "data_source": data_source,
        "reward_model": reward_model,
        "ground_truth": reward_model["ground_truth"],
        "extra_info": extra_info,
        "index": extra_info.get("index", i),
        "ability": row.get("ability"),
    }


def _parse_prompt(prompt, where: str, key: str) -> list[dict]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: field {key!r} is an empty string")
        return [{"role": "user", "content": prompt}]
    if prompt is None:
        raise ValueError(f"{where}: field {key!r} is missing")
    if isinstance(prompt, np.ndarray):  # some parquet readers return object arrays
        prompt = prompt.tolist()
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: field {key!r} must be a non-empty list of chat messages, got {prompt!r}")
    for j, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: field '{key}[{j}]' must be a dict with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}: field '{key}[{j}].role' must be a non-empty string, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: field '{key}[{j}].content' must be a string, got {type(content).__name__}")
    if not any(m["content"].strip() for m in prompt):
        raise ValueError(f"{where}: field {key!r} has only empty message contents")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def check_tokenization(input_ids, attention_mask, *, where: str, vocab_size: int | None = None) -> None:
    """Tokenizer consistency for one unpadded prompt: ids and mask have equal, non-zero length, the
    mask is all ones, and every id is a valid token id. A ValueError names `where` otherwise."""
    if len(input_ids) != len(attention_mask):
        raise ValueError(
            f"{where}: tokenizer returned {len(input_ids)} input_ids but {len(attention_mask)} attention_mask entries"
        )
    if len(input_ids) == 0:
        raise ValueError(f"{where}: the prompt tokenized to zero tokens")
    if any(m != 1 for m in attention_mask):
        raise ValueError(f"{where}: attention_mask of an unpadded prompt has zeros: {list(attention_mask)}")
    if vocab_size is not None:
        bad = [t for t in input_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


class PromptCollator:
    """Left-pads a list of samples into ``input_ids``, ``attention_mask``, ``position_ids`` (B, S)
    int64 tensors, and turns the other fields into numpy object arrays of length B.

    S is the longest prompt in the batch, or `pad_to_length` when given (a fixed width for engines
    that want one). Left padding puts every prompt's last token in the last column, where
    generation continues; position ids count real tokens only (0 on padding).
    """

    def __init__(self, pad_token_id: int, pad_to_length: int | None = None):
        if pad_token_id is None:
            raise ValueError("pad_token_id is None; load the tokenizer with ballast.models.load_tokenizer")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_length = pad_to_length

    def __call__(self, samples: list[dict]) -> dict:
        if not samples:
            raise ValueError("cannot collate an empty list of samples")
        lengths = [int(s["input_ids"].numel()) for s in samples]
        width = max(lengths)
        if self.pad_to_length is not None:
            if width > self.pad_to_length:
                raise ValueError(f"a prompt has {width} tokens > pad_to_length={self.pad_to_length}")
            width = self.pad_to_length
        input_ids = torch.full((len(samples), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
        for row, (sample, length) in enumerate(zip(samples, lengths)):
            input_ids[row, width - length :] = sample["input_ids"]
            attention_mask[row, width - length :] = 1
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        for key in NON_TENSOR_KEYS:
            # np.empty + assignment: np.array(list_of_lists) would build a 2-D array.
            column = np.empty(len(samples), dtype=object)
            for row, sample in enumerate(samples):
                column[row] = sample.get(key)
            batch[key] = column
        return batch
