"""The weight-sync check's rounding gap: how far a vLLM engine's log-probs on the probe are from the
trainer's on the same weights, at start-up and after the weights moved, for the text probe and for
random token ids. It sets the check's margin, floors and ceilings (ballast/workers/sync_check.py).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sync_check_gap.py --model-dir DIR --dtype bfloat16 --json out.json

The trainer side is a Hugging Face forward in float32 (the CPU trainer's precision) and in bfloat16.
"The weights moved": every floating tensor gets Gaussian noise of `rel` x its standard deviation,
loaded into both sides (vLLM's in-place `reload_weights`), which is how a sync after an update looks;
`effect` is how far that moved the trainer's log-probs, `served_vs_old` how far the engine is from the
weights before the move (what a missed sync would serve). Prints one line per measurement, then JSON
with `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from machine import cpu_info  # noqa: E402

RANDOM_TOKENS = 16  # the probe of random ids the check used before


def _mean_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().mean())


def _hf_log_probs(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([seq])
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]


def _moved(state: dict, rel: float, generator: torch.Generator) -> dict:
    """Every floating tensor with more than one element plus `rel` x its std of Gaussian noise."""
    if rel == 0:
        return dict(state)
    return {k: (v + rel * v.float().std() * torch.randn(v.shape, generator=generator)).to(v.dtype)
            if v.is_floating_point() and v.numel() > 1 else v for k, v in state.items()}


def measure(model_dir: str, dtype: str, rels: list[float]) -> dict:
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ballast.models import load_tokenizer
    from ballast.workers.sync_check import probe_tokens

    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True, max_model_len=256,
              kv_cache_memory_bytes=64 << 20, seed=0, logprobs_mode="processed_logprobs", generation_config="vllm")
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    probes = {"text": list(probe_tokens(load_tokenizer(model_dir), vocab)),
              "random": [int(t) for t in np.random.default_rng(0).integers(0, vocab, RANDOM_TOKENS)]}
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)

    def served(seq):
        out = llm.generate([TokensPrompt(prompt_token_ids=seq)], params, use_tqdm=False)[0]
        return torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], seq[1:])])

    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    result = {"model_dir": model_dir, "vllm_dtype": dtype, "probe_tokens": {k: len(v) for k, v in probes.items()}}
    for name, seq in probes.items():
        s = served(seq)
        start = _hf_log_probs(fp32, seq)
        result[name] = {"mean_abs_log_prob": float(start.abs().mean()), "start_gap_fp32": _mean_abs(s, start),
                        "start_gap_bf16": _mean_abs(s, _hf_log_probs(bf16, seq)), "moved": {}}
        print(f"{name}: start-up gap {result[name]['start_gap_fp32']:.3g} (fp32 trainer), "
              f"{result[name]['start_gap_bf16']:.3g} (bf16 trainer)", flush=True)
    original = {k: v.clone() for k, v in fp32.state_dict().items()}
    before = {name: _hf_log_probs(fp32, seq) for name, seq in probes.items()}
    generator = torch.Generator().manual_seed(0)
    for rel in rels:
        weights = _moved(original, rel, generator)
        fp32.load_state_dict(weights)
        llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=list(weights.items()),
                                                         is_checkpoint_format=True))
        llm.reset_prefix_cache()
        for name, seq in probes.items():
            s, t = served(seq), _hf_log_probs(fp32, seq)
            row = {"gap": _mean_abs(s, t), "effect": _mean_abs(t, before[name]), "served_vs_old": _mean_abs(s, before[name])}
            result[name]["moved"][f"{rel:g}"] = row
            print(f"{name}, weights moved by {rel:g}: gap {row['gap']:.3g}, effect {row['effect']:.3g}, "
                  f"served vs old {row['served_vs_old']:.3g}", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="a Hugging Face model directory with its tokenizer")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--moves", default="0,0.001,0.01", help="relative weight moves to measure, comma-separated")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    torch.set_num_threads(1)
    result = {"machine": {"cpu": cpu_info()}, "date": time.strftime("%Y-%m-%d %H:%M"),
              **measure(args.model_dir, args.dtype, [float(x) for x in args.moves.split(",")])}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
