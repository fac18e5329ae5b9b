"""The driver's data: training prompts as Batches with a uid per prompt, and the validation set.

Training reads at most `trainer.total_epochs` passes over the data, as verl's loop does: the batch
after the last one of the last epoch raises `DataExhausted`, and the trainer ends the run there. A
plain run ends before that (its step count is the number of batches in `total_epochs`, or a smaller
`trainer.total_training_steps`); a run that draws more than one batch per step (dynamic sampling)
or asks for more steps than the epochs hold ends early, saying so.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ballast.data import PromptCollator, RLDataset, StatefulDataLoader
from ballast.protocol import Batch
from ballast.trainer.config import BallastConfig
from ballast.trainer.config.keys import build

TENSOR_KEYS = ("input_ids", "attention_mask", "position_ids")


class DataExhausted(RuntimeError):
    """The training data of `trainer.total_epochs` epochs is used up."""


def collated_to_batch(collated: dict, uid_prefix: str) -> Batch:
    tensors = {k: collated[k] for k in TENSOR_KEYS}
    non_tensors = {k: v for k, v in collated.items() if k not in TENSOR_KEYS}
    # Deterministic uids: a resumed run names its prompts exactly like an uninterrupted one.
    non_tensors["uid"] = np.array([f"{uid_prefix}-{i}" for i in range(len(collated["input_ids"]))], dtype=object)
    return Batch(tensors, non_tensors)


class RunData:
    """Read before the run is planned (the step count comes from here), so a setting the dataset or
    loader refuses is reported with its config key (`build`), like the specs' settings."""

    def __init__(self, cfg: BallastConfig, tokenizer) -> None:
        d = cfg.data
        truncation = "filter" if d.filter_overlong_prompts else str(d.truncation)
        keys = {"max_prompt_length": "data.max_prompt_length",
                "batch_size": "data.gen_batch_size" if d.gen_batch_size else "data.train_batch_size"}
        self.collate = PromptCollator(tokenizer.pad_token_id)
        self.train_set = build(keys, RLDataset, d.train_files, tokenizer, max_prompt_length=d.max_prompt_length,
                               truncation=truncation, prompt_key=d.prompt_key)
        self.loader = build(
            keys, StatefulDataLoader, self.train_set, d.gen_batch_size or d.train_batch_size, shuffle=d.shuffle,
            seed=d.seed, drop_last=True,
            collate_fn=self.collate, num_workers=d.dataloader_num_workers,
            prefetch_factor=d.prefetch_factor if d.dataloader_num_workers > 0 else None,
            persistent_workers=d.persistent_workers,
        )
        t = cfg.trainer
        per_epoch = len(self.loader)
        self.total_epochs = t.total_epochs
        self.total_steps = t.total_training_steps or t.total_epochs * per_epoch
        self.val: Optional[Batch] = None
        self.agent_names = dict(self.train_set.agent_names)
        """Each `agent_name` of the training and validation rows, with the first row naming it."""
        if d.val_files:
            val_set = RLDataset(d.val_files, tokenizer, max_prompt_length=d.max_prompt_length,
                                truncation=truncation, prompt_key=d.prompt_key)
            self.val = collated_to_batch(self.collate([val_set[i] for i in range(len(val_set))]), "val")
            self.agent_names = {**val_set.agent_names, **self.agent_names}
        self.val_batch_size = d.val_batch_size
        self._iter = None

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    @property
    def pad_token_id(self) -> int:
        return self.collate.pad_token_id

    def next_prompts(self, step: int, uid_prefix: Optional[str] = None) -> Batch:
        """The next training batch; uids are `<uid_prefix or step{step}>-<row>`.

        Raises DataExhausted once `trainer.total_epochs` epochs have been handed out."""
        while True:
            if self._iter is None:
                if self.loader.epoch >= self.total_epochs:
                    raise DataExhausted(
                        f"the training data of trainer.total_epochs={self.total_epochs} is used up "
                        f"({self.total_epochs} x {len(self.loader)} batches of {self.loader.batch_size} prompts)")
                self._iter = iter(self.loader)
            try:
                return collated_to_batch(next(self._iter), uid_prefix or f"step{step}")
            except StopIteration:
                self._iter = None

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._iter = None
