"""The rollout's log-probs line up with the training engine's token for token, which rollout correction
relies on: sampled responses cut at an EOS (so rows end at different columns, padding after), the
engine's log-probs with remove-padding on and off, static and dynamic micro-batches. Every sampled
token's rollout log-prob equals the engine's; every slot after the response is 0 in both."""

import os

import numpy as np
import pytest
import torch
import transformers

from ballast.engine import EngineConfig, MicroBatchSpec, TrainEngine
from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend
from testkit.engine import spawn_ranks
from testkit.models import build_tiny_qwen2
from testkit.prompts import left_padded_prompts
from testkit.rollout import generate

transformers.utils.logging.disable_progress_bar()
PROMPTS = [[5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15, 16, 17], [9], [3, 4, 5]] * 2
TEMPERATURE = 0.8


def _eos_for(model_dir):
    """A token the sampler emits early in some rows but not all (so EOS cuts rows at different columns)."""
    cfg = RolloutConfig(model_path=model_dir, backend="hf", device="cpu",
                        sampling=SamplingConfig(max_response_length=12, temperature=TEMPERATURE, seed=3,
                                                eos_token_ids=()))
    free = generate(build_backend(cfg), left_padded_prompts(PROMPTS))["responses"]
    counts = np.bincount(free[:, 2:8].reshape(-1).numpy())
    return int(np.argmax(counts))


def _worker(rank, world, root, model_dir):
    eos = int(open(os.path.join(root, "eos")).read())
    sampling = SamplingConfig(max_response_length=12, temperature=TEMPERATURE, seed=3, eos_token_ids=(eos,),
                              calculate_log_probs=True)
    backend = build_backend(RolloutConfig(model_path=model_dir, backend="hf", device="cpu", sampling=sampling))
    out = generate(backend, left_padded_prompts(PROMPTS))
    mask = out["response_mask"].bool()
    lengths = out["response_mask"].sum(-1)
    assert 0 < int((lengths < 12).sum()) < len(PROMPTS), lengths  # some rows stop at EOS, some run on
    assert (out["rollout_log_probs"][~mask] == 0).all()
    errors = {}
    for rmpad in (True, False):
        engine = TrainEngine(EngineConfig(model_path=model_dir, use_remove_padding=rmpad))
        for name, spec in (("static-3", MicroBatchSpec(micro_batch_size_per_gpu=3)),
                           ("dynamic", MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=40))):
            got = engine.infer_batch(out, engine.plan_micro_batches(out, spec), temperature=TEMPERATURE)["log_probs"]
            assert (got[~mask] == 0).all()
            errors[f"rmpad={rmpad} {name}"] = float((got - out["rollout_log_probs"]).abs()[mask].max())
    torch.save(errors, os.path.join(root, "errors.pt"))


def test_rollout_log_probs_equal_the_engines_for_every_sampled_token(tmp_path):
    model_dir = build_tiny_qwen2(str(tmp_path / "model"))
    (tmp_path / "eos").write_text(str(_eos_for(model_dir)))
    spawn_ranks(_worker, 1, args=(str(tmp_path), model_dir), timeout_s=300)
    errors = torch.load(tmp_path / "errors.pt")
    assert len(errors) == 4
    assert max(errors.values()) < 1e-4, errors
