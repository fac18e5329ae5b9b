"""The "same tokens" fixture (tests/fixtures/same_tokens.json): the tokens today's rollout must keep sampling.

The fixture was recorded once, from the batched rollout path of the commit it names
(`generated_from_commit`), by tests/fixtures/make_same_tokens.py (whose docstring says how, and why it
is never regenerated). It holds its own inputs (prompts, sampling calls with their call index, the
engines' settings, fingerprints of the two tiny models) and what each engine returned: per row the
response ids, the response mask and the rollout log-probs rounded to 4 decimals. Tests run the same
calls on the current tree through the generate path the rollout worker uses (`generate_with`: the one
place to follow a change of that API) and compare with `assert_same_tokens`:

    fixture = load()
    check_model(fixture, "tiny", model_dir)                   # the model itself did not change
    check_engine(fixture, "vllm_tp1", backend)                # nor the engine's settings
    outs = run_calls(fixture, generate_with(runner), fixture["prompts"]["tp1"])
    for name, out in outs.items():
        assert_same_tokens(fixture["results"]["vllm_tp1"][name], out, f"vllm_tp1/{name}")

Token ids and masks must be equal; log-probs (which differ between CPUs in their low bits) within
`LOG_PROB_ATOL` on sampled tokens. Nothing here imports ballast at module level: the fixture's generator
imports `weights_fingerprint` while running against the old tree.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "same_tokens.json"
LOG_PROB_ATOL = 2e-3
FINGERPRINT_RTOL = 1e-5  # of a tensor's sum of |w|; float32 rounding of every weight is ~1e-7


def load() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


def weights_fingerprint(model_dir) -> dict:
    """Per tensor of a model directory's safetensors files: [shape, sum, sum of |w|] (float64). Not a
    digest of the bytes: the tiny model's random init differs between CPUs in the last bit (torch's
    vectorised normal_ kernels: its weights built with ATEN_CPU_CAPABILITY=default and =avx2 differ),
    while a change of the builder (seed, sizes, init std) moves these sums far beyond rounding."""
    import torch
    from safetensors import safe_open

    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in sorted(f.keys()):
                tensor = f.get_tensor(name).double()
                out[name] = [list(tensor.shape), float(tensor.sum()), float(tensor.abs().sum())]
    return out


def check_model(fixture: dict, model: str, model_dir) -> None:
    """AssertionError when `model_dir` is not the model the fixture was recorded with: then the model
    builder changed, not the rollout, and the token comparison would say nothing."""
    expected = fixture["models"][model]
    got = weights_fingerprint(model_dir)
    changed = sorted(set(got) ^ set(expected["weights"]))
    for name, (shape, total, magnitude) in expected["weights"].items():
        if name in got and (got[name][0] != shape or abs(got[name][1] - total) > FINGERPRINT_RTOL * magnitude
                            or abs(got[name][2] - magnitude) > FINGERPRINT_RTOL * magnitude):
            changed.append(name)
    assert not changed, (
        f"model {model!r} built with {expected['build']} is not the one the fixture was recorded with (tensors "
        f"{changed[:4]} differ): the tiny-model builder changed, so this test cannot say whether the rollout "
        "still samples the same tokens")


def check_engine(fixture: dict, engine: str, backend) -> None:
    """AssertionError when a test's engine differs from the recorded one: its settings (the batch an
    engine schedules can move fp32 logits in their last bits, so they are part of the input) and the
    ids it ends responses at and pads with."""
    recorded = fixture["engines"][engine]
    for key, value in recorded["config"].items():
        got = getattr(backend.config, key)
        assert got == value, f"{engine}: engine setting {key}={got!r}, the fixture was recorded with {value!r}"
    got = {"eos_token_ids": list(backend.eos_token_ids), "pad_token_id": int(backend.pad_token_id)}
    assert got == recorded["resolved"], f"{engine}: the engine resolved {got}, recorded {recorded['resolved']}"


def sampling(call: dict):
    """The SamplingConfig of one recorded call."""
    from ballast.workers.rollout import SamplingConfig

    return SamplingConfig(**{k: v for k, v in call.items() if k != "call_index"})


def prompts(token_lists):
    """Left-padded prompts with position ids, as the worker receives them."""
    from testkit.prompts import left_padded_prompts

    return left_padded_prompts(token_lists, position_ids=True)


def generate_with(runner):
    """The rollout worker's generate path as `generate(prompts, sampling, call_index) -> TensorDict`: agent
    loops (single-turn here) on the request-level core, under the runner's TP group if it has one."""
    from ballast.protocol import Batch

    return lambda p, s, i: runner.generate(Batch(p), s, call_index=i).tensors


def run_calls(fixture: dict, generate, token_lists) -> dict:
    """Every recorded call through `generate`: call name -> its output TensorDict."""
    return {name: generate(prompts(token_lists), sampling(call), call["call_index"])
            for name, call in fixture["calls"].items()}


def assert_same_tokens(expected: dict, out, where: str) -> None:
    """`out` (responses, response_mask, rollout_log_probs) holds exactly the recorded tokens."""
    import torch

    responses, mask = out["responses"].tolist(), out["response_mask"].tolist()
    assert len(responses) == len(expected["responses"]), f"{where}: {len(responses)} rows, recorded " \
                                                         f"{len(expected['responses'])}"
    for row, (want, got, want_mask, got_mask) in enumerate(zip(expected["responses"], responses,
                                                               expected["response_mask"], mask)):
        assert got == want and got_mask == want_mask, (
            f"{where}: row {row} sampled {got} (mask {got_mask}), the batched rollout recorded in the fixture sampled "
            f"{want} (mask {want_mask})")
    real = torch.tensor(expected["response_mask"]).bool()
    got_lps = out["rollout_log_probs"].float()[real]
    want_lps = torch.tensor(expected["rollout_log_probs"], dtype=torch.float32)[real]
    worst = float((got_lps - want_lps).abs().max()) if real.any() else 0.0
    assert worst <= LOG_PROB_ATOL, f"{where}: rollout log-probs differ from the recorded ones by up to {worst:.2e}"
