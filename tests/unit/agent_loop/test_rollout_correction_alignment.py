"""Rollout correction on multi-turn conversations: the tool tokens inside a response (response_mask 0,
never sampled) carry rollout log-prob 0 and take no part in any weight, rejection or metric.

Each scripted tool conversation is assembled into the rollout output, then corrected twice under
every preset: as it is (holes in the mask where the tool tokens are, a wildly different train-time
log-prob on them) and compacted to its sampled tokens only. Both must agree on every sampled token
and in every metric, which fails if any statistic reads a position the mask excludes.
"""

import pytest
import torch

from ballast.trainer.algorithms.rollout_correction import correct, parse_rollout_correction
from ballast.trainer.algorithms.rollout_correction_metrics import correction_metrics
from ballast.trainer.algorithms.rollout_correction_presets import PRESETS
from ballast.workers.agent_loop.output import assemble

from test_tool_loop import run_rows

# every preset that corrects, and Ballast's extension masks (tv, bkl, absk1 read log-probs directly)
SETTINGS = {name: fn() for name, fn in sorted(PRESETS.items()) if name != "disabled"}
SETTINGS.update({
    "token_tv": dict(rollout_rs="token_tv", rollout_rs_threshold=0.05),
    "token_bkl": dict(rollout_rs="token_bkl", rollout_rs_threshold=0.01),
    "seq_max_absk1": dict(rollout_is="sequence", rollout_rs="seq_max_absk1", rollout_rs_threshold=1.05),
})
GARBAGE = -9.0  # train-time log-prob on positions no one sampled: a huge ratio if it leaked in


@pytest.fixture(scope="module")
def conversations(tiny_tokenizer):
    outputs, _, _ = run_rows(tiny_tokenizer)
    outs = [outputs[k] for k in sorted(outputs)]
    width = max(len(o.prompt_ids) for o in outs)
    input_ids = torch.zeros((len(outs), width), dtype=torch.int64)
    attention = torch.zeros_like(input_ids)
    for i, o in enumerate(outs):
        input_ids[i, width - len(o.prompt_ids):] = torch.tensor(o.prompt_ids)
        attention[i, width - len(o.prompt_ids):] = 1
    batch = assemble(input_ids, attention, attention.cumsum(-1).clamp(min=1) - 1, outs, pad_token_id=0,
                     prompt_length=width, response_length=None, with_log_probs=True)
    return outs, batch


def test_rollout_log_probs_line_up_with_the_response_mask(conversations):
    outs, batch = conversations
    mask, lps = batch["response_mask"].bool(), batch["rollout_log_probs"]
    assert (~mask & batch["attention_mask"][:, -mask.shape[1]:].bool()).any()  # tool tokens inside responses
    assert torch.all(lps[~mask] == 0)
    for i, o in enumerate(outs):
        sampled = [lp for lp, m in zip(o.log_probs, o.response_mask) if m]
        assert lps[i][mask[i]].tolist() == pytest.approx(sampled)
        assert all(lp < 0 for lp in sampled)


def _train_log_probs(rollout, mask):
    g = torch.Generator().manual_seed(0)
    noisy = rollout + 0.3 * torch.randn(rollout.shape, generator=g, dtype=rollout.dtype)
    return torch.where(mask.bool(), noisy.clamp(max=-1e-3), torch.full_like(rollout, GARBAGE))


def _compact(values, mask, fill):
    rows = [v[m.bool()] for v, m in zip(values, mask)]
    out = torch.full((len(rows), max(len(r) for r in rows)), fill, dtype=values.dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_tool_tokens_take_no_part_in_the_correction(conversations, name):
    _, batch = conversations
    mask = batch["response_mask"]
    rollout = batch["rollout_log_probs"].double()
    train = _train_log_probs(rollout, mask)
    corr = parse_rollout_correction(**SETTINGS[name])
    holes = correct(train, rollout, mask, corr)
    c_mask = _compact(mask, mask, 0)
    c_train, c_rollout = _compact(train, mask, GARBAGE), _compact(rollout, mask, 0.0)
    compact = correct(c_train, c_rollout, c_mask, corr)
    assert torch.equal(_compact(holes.mask, mask, 0), compact.mask)
    if holes.weights is not None:
        torch.testing.assert_close(_compact(holes.weights.weights, mask, 0.0), compact.weights.weights * c_mask)
        assert torch.all(holes.weights.weights[~mask.bool()] == 0)
    got = correction_metrics(train, rollout, mask, corr, holes)
    want = correction_metrics(c_train, c_rollout, c_mask, corr, compact)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key
