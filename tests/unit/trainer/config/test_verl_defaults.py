"""Every default Ballast shares with verl 0.9.1 is verl's, or a listed difference documented in docs/config.md.

Both configs are resolved the same way (the few values each requires are set to the same placeholders
first), flattened to dotted keys, and compared on the keys both have. A difference not listed in
`INTENDED` fails, and so does a listed one that no longer differs (the list stays exact). Each listed
key must be named in the "Defaults that differ from verl" section of docs/config.md, which says why.

verl is installed by scripts/setup.sh (`pip install --no-deps verl==0.9.1`); without it (the GPU Docker
image) the module is skipped at collection.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ballast.trainer.config import compose

verl = pytest.importorskip("verl", reason="verl 0.9.1 is not installed (bash scripts/setup.sh installs it): its "
                           "generated trainer yaml is the reference of these defaults")

VERL_YAML = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
DOCS = Path(__file__).resolve().parents[4] / "docs" / "config.md"
# Values both configs need before they resolve (each has a placeholder or a mandatory `???` there).
PLACEHOLDERS = {"actor_rollout_ref.model.path": "/model", "data.train_files": "/train.parquet",
                "data.val_files": "/val.parquet", "actor_rollout_ref.rollout.name": "vllm"}

# key -> (Ballast's default, verl's): the differences docs/config.md explains.
INTENDED = {
    "data.seed": (1, None),
    "data.dataloader_num_workers": (0, 8),
    "actor_rollout_ref.model.enable_gradient_checkpointing": (False, True),
    "critic.model.enable_gradient_checkpointing": (False, True),
    "actor_rollout_ref.actor.strategy": ("fsdp2", "fsdp"),
    "critic.strategy": ("fsdp2", "fsdp"),
    "actor_rollout_ref.ref.fsdp_config.optimizer_offload": (None, False),
    "actor_rollout_ref.ref.fsdp_config.fsdp_size": (None, -1),
    "actor_rollout_ref.rollout.mode": ("sync", "async"),
    "actor_rollout_ref.rollout.dtype": ("auto", "bfloat16"),
    "actor_rollout_ref.rollout.enforce_eager": (True, False),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (1, 2),
    "actor_rollout_ref.rollout.seed": (0, 42),
    "critic.model.path": ("/model", "~/models/deepseek-llm-7b-chat"),
    "custom_reward_function.name": ("compute_score", None),
    "reward_model.reward_manager": ("naive", None),
    "trainer.device": ("auto", "cuda"),
    "trainer.project_name": ("ballast", "verl_examples"),
    "trainer.experiment_name": ("default", "gsm8k"),
    "trainer.default_local_dir": ("checkpoints/ballast/default", "checkpoints/verl_examples/gsm8k"),
    "trainer.logger": (["console"], ["console", "wandb"]),
}


def _flat(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def _verl_defaults() -> dict:
    cfg = OmegaConf.load(VERL_YAML)
    for key, value in PLACEHOLDERS.items():
        OmegaConf.update(cfg, key, value)
    return dict(_flat(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)))


def _ballast_defaults() -> dict:
    plain = OmegaConf.to_container(compose([f"{k}={v}" for k, v in PLACEHOLDERS.items()]), resolve=True,
                                   throw_on_missing=False)
    plain.pop("hydra", None)
    return dict(_flat(plain))


def test_every_shared_default_is_verls_or_a_listed_difference():
    assert verl.__version__.startswith("0.9.1"), verl.__version__  # the list is of verl 0.9.1's values
    ours, theirs = _ballast_defaults(), _verl_defaults()
    shared = [key for key in ours if key in theirs]
    assert len(shared) > 150, len(shared)  # the comparison covers the config, not a corner of it
    differ = {key: (ours[key], theirs[key]) for key in shared if ours[key] != theirs[key]}
    unlisted = {k: v for k, v in differ.items() if k not in INTENDED}
    assert not unlisted, f"defaults that differ from verl's without a reason in INTENDED/docs/config.md: {unlisted}"
    assert differ == INTENDED  # a listed difference that is gone (or changed) is taken off the list


def test_every_listed_difference_is_explained_in_the_config_docs():
    text = DOCS.read_text()
    match = re.search(r"^## Defaults that differ from verl\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, "docs/config.md has no 'Defaults that differ from verl' section"
    section = match.group(1)
    missing = [key for key in INTENDED if f"`{key}`" not in section]
    assert not missing, f"not explained in docs/config.md: {missing}"

