"""The reward model's forward on a (dp=2) gloo mesh scores every conversation as the Hugging Face
sequence classifier does, however the batch is cut: static or token-budget micro-batches, packed or
padded, each rank's share of a balanced plan."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from ballast.balance import MicroBatchMode, MicroBatchPolicy
from ballast.engine import EngineConfig, TrainEngine
from ballast.engine.dist import build_parallel_state
from ballast.models.reward_model import save_reward_model
from ballast.protocol import Batch
from ballast.trainer.step.reward_model import RewardModelScorer
from testkit.engine import spawn_ranks
from testkit.models import build_tiny_causal_lm

transformers.utils.logging.disable_progress_bar()
LENGTHS = [5, 31, 12, 47, 3, 22, 9, 40, 17, 26, 8, 35]
POLICIES = {"static1": MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=1),
            "static4": MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=4),
            "dynamic64": MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=64),
            "dynamic200": MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=200)}


def _rows(seed=3):
    """Reward-model rows (conversation in the prompt columns, one placeholder response token)."""
    gen = np.random.default_rng(seed)
    width = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), width + 1, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        ids[i, width - n:width] = torch.from_numpy(gen.integers(3, 120, n))
        mask[i, width - n:] = 1
    ids[:, width] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, width:].clone(),
                  "response_mask": mask[:, width:].clone()})


def _hf_scores(rm_dir, rows):
    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    width = rows["input_ids"].shape[1] - 1
    out = []
    with torch.no_grad():
        for i in range(len(rows)):
            ids = rows["input_ids"][i, :width][rows["attention_mask"][i, :width].bool()]
            out.append(float(model(input_ids=ids[None]).logits[0, 0]))
    return np.array(out)


def _rank(rank, world, rm_dir, want, out_dir):
    rows = _rows()
    parallel = build_parallel_state(1, "cpu")
    worst = {}
    for packed in (True, False):
        engine = TrainEngine(EngineConfig(model_path=rm_dir, role="reward", device="cpu", grad_clip=None,
                                          use_remove_padding=packed), parallel=parallel)
        for name, policy in POLICIES.items():
            plan = RewardModelScorer(None, None, world, policy).plan(rows)
            mine = rows[plan.rank_rows(rank)]
            got = engine.infer_batch(mine.tensors, plan.mini_batches[0])["values"][:, 0].numpy()
            worst[f"{name}/packed={packed}"] = float(np.abs(got - want[plan.rank_rows(rank)]).max())
    np.save(f"{out_dir}/rank{rank}.npy", np.array(list(worst.values())))
    bad = {k: v for k, v in worst.items() if not v < 1e-5}
    assert not bad, bad


def test_reward_model_scores_equal_the_classifier_however_cut(tmp_path):
    lm = build_tiny_causal_lm(str(tmp_path / "lm"), vocab_size=128)
    rm_dir = str(tmp_path / "rm")
    save_reward_model(lm, rm_dir, seed=1, head_std=0.5)
    want = _hf_scores(rm_dir, _rows())
    assert np.std(want) > 1e-3  # the scores differ between conversations: the check can see a mix-up
    spawn_ranks(_rank, 2, args=(rm_dir, want, str(tmp_path)), timeout_s=240)
    for r in range(2):
        assert np.load(tmp_path / f"rank{r}.npy").max() < 1e-5
