"""Schema of the `data` section: where prompts come from and how they are batched and cut."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ballast.trainer.config.schema.choice import choice

# The dataset's modes (`ballast.data.TRUNCATION_MODES`; a test keeps the two equal).
Truncation = choice("Truncation", __name__, "error", "left", "right", "middle", "filter")


@dataclass(frozen=True)
class DataConfig:
    train_files: Any
    """Training prompts: a parquet/jsonl path or a list of paths (verl accepts both); a list after loading."""
    val_files: Any
    """Validation prompts: null (no validation), a path or a list of paths."""
    prompt_key: str
    """Column holding the prompt (a chat message list or a string)."""
    reward_fn_key: str
    """Column naming each row's data source, which picks the built-in reward function."""
    max_prompt_length: int
    """Longest prompt in tokens; longer ones are handled as `truncation` says."""
    max_response_length: int
    """Most tokens generated per response."""
    train_batch_size: int
    """Prompts per training step (each answered `actor_rollout_ref.rollout.n` times)."""
    gen_batch_size: Optional[int]
    """DAPO: prompts per generation batch with `algorithm.filter_groups`; null: `train_batch_size`."""
    val_batch_size: Optional[int]
    """Validation prompts per generate call; null: the whole validation set at once."""
    truncation: Truncation
    """Overlong prompts: `error`, `left`, `right`, `middle` (first + last half) or `filter` (dropped, counted)."""
    return_raw_chat: bool
    """Accepted for verl compatibility, no effect here: the chat messages are always kept (agent loops read them)."""
    filter_overlong_prompts: bool
    """verl's switch: true means the same as `truncation=filter`."""
    shuffle: bool
    """Shuffle the training prompts every epoch."""
    seed: int
    """Seed of the prompt shuffle."""
    dataloader_num_workers: int
    """Data-loader worker processes; 0 builds batches in the driver process."""
    prefetch_factor: int
    """Batches each loader worker prepares ahead; used only with `dataloader_num_workers > 0`."""
    persistent_workers: bool
    """Keep loader worker processes alive between epochs (needs `dataloader_num_workers > 0`)."""
