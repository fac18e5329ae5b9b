"""Ballast's data: RL prompt datasets in verl's format, a resumable dataloader, rule rewards, and
the built-in synthetic task.

Public API:
    RLDataset(files, tokenizer, *, max_prompt_length, truncation, prompt_key, chat_template_kwargs)
    PromptCollator(pad_token_id, pad_to_length=None)            # left-padded batches
    StatefulDataLoader(dataset, batch_size, *, shuffle, seed, drop_last, collate_fn,
                       num_workers, prefetch_factor, persistent_workers)  # state_dict/load_state_dict
    read_rows(path), write_parquet(rows, path), write_jsonl(rows, path)
    make_repeat_rows(...), write_repeat_dataset(out_dir, ...)   # synthetic task
    repeat_score, gsm8k_score, default_compute_score, get_reward_fn, register_reward_fn,
    validate_score, load_custom_reward_fn                      # rewards
    score_extra_info, ROLLOUT_EXTRA_INFO_KEYS                  # what a score function's extra_info holds
    gsm8k_rows, convert_gsm8k_file                             # GSM8K preprocessing
    make_arithmetic_rows, write_arithmetic_dataset, arithmetic_score  # real-model arithmetic task
    make_tool_arithmetic_rows, write_tool_arithmetic_dataset, tool_arithmetic_score  # ... with a calculator
"""

from ballast.data.arithmetic import arithmetic_score, make_arithmetic_rows, write_arithmetic_dataset
from ballast.data.dataset import (
    TRUNCATION_MODES,
    DatasetStats,
    PromptCollator,
    RLDataset,
    check_tokenization,
)
from ballast.data.gsm8k import convert_gsm8k_file, gsm8k_rows
from ballast.data.io import read_rows, write_jsonl, write_parquet
from ballast.data.loader import ResumableSampler, StatefulDataLoader
from ballast.data.rewards import (
    ROLLOUT_EXTRA_INFO_KEYS,
    default_compute_score,
    extract_gsm8k_answer,
    get_reward_fn,
    gsm8k_score,
    load_custom_reward_fn,
    register_reward_fn,
    registered_data_sources,
    repeat_score,
    score_extra_info,
    validate_score,
)
from ballast.data.synthetic import DATA_SOURCE as REPEAT_DATA_SOURCE
from ballast.data.tool_arithmetic import (
    make_tool_arithmetic_rows,
    tool_arithmetic_score,
    write_tool_arithmetic_dataset,
)
from ballast.data.synthetic import make_repeat_rows, write_repeat_dataset

__all__ = [
    "arithmetic_score",
    "make_arithmetic_rows",
    "write_arithmetic_dataset",
    "TRUNCATION_MODES",
    "DatasetStats",
    "PromptCollator",
    "RLDataset",
    "check_tokenization",
    "convert_gsm8k_file",
    "gsm8k_rows",
    "read_rows",
    "write_jsonl",
    "write_parquet",
    "ResumableSampler",
    "StatefulDataLoader",
    "default_compute_score",
    "extract_gsm8k_answer",
    "get_reward_fn",
    "gsm8k_score",
    "load_custom_reward_fn",
    "register_reward_fn",
    "registered_data_sources",
    "repeat_score",
    "ROLLOUT_EXTRA_INFO_KEYS",
    "score_extra_info",
    "validate_score",
    "REPEAT_DATA_SOURCE",
    "make_repeat_rows",
    "write_repeat_dataset",
    "make_tool_arithmetic_rows",
    "tool_arithmetic_score",
    "write_tool_arithmetic_dataset",
]
