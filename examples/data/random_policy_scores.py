"""How the synthetic task's reward looks to an untrained policy: is there signal at step one?

    python examples/data/random_policy_scores.py [--num-prompts 64] [--n 4] [--max-response-length 256] [--hf]

Scores GRPO-style groups of `n` responses per prompt from (a) a uniform-random-token policy (each
token uniform over the tokenizer's vocabulary, stopping at eos) and, with --hf, (b) the random-init
tiny model itself sampled with temperature 1 by transformers `generate`. Prints one JSON object per
policy: score mean/std/percentiles, the fraction of groups whose scores are not all equal (a group
with equal scores gives GRPO zero advantage), and the mean within-group std.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from ballast.data.rewards import repeat_score
from ballast.data.synthetic import make_repeat_rows
from ballast.models import load_tokenizer, tiny_model_dir


def summarise(name: str, scores: np.ndarray) -> dict:
    """scores: (num_prompts, n)."""
    group_std = scores.std(axis=1)
    return {
        "policy": name,
        "num_samples": int(scores.size),
        "mean": round(float(scores.mean()), 4),
        "std": round(float(scores.std()), 4),
        "p10_p50_p90": [round(float(x), 4) for x in np.percentile(scores, [10, 50, 90])],
        "max": round(float(scores.max()), 4),
        "frac_groups_with_spread": round(float(np.mean(group_std > 1e-12)), 4),
        "mean_within_group_std": round(float(group_std.mean()), 4),
    }


def uniform_policy_scores(tokenizer, rows, n, max_len, rng) -> np.ndarray:
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    scores = np.zeros((len(rows), n))
    for i, row in enumerate(rows):
        truth = row["reward_model"]["ground_truth"]
        for j in range(n):
            ids = rng.integers(0, vocab, size=max_len)
            stops = np.flatnonzero(ids == eos)
            ids = ids[: stops[0]] if stops.size else ids
            text = tokenizer.decode(ids.tolist(), skip_special_tokens=True)
            scores[i, j] = repeat_score(row["data_source"], text, truth)["score"]
    return scores


def model_policy_scores(model_dir, tokenizer, rows, n, max_len, seed) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    enc = tokenizer([t for t in texts for _ in range(n)], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=max_len, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
    responses = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    truths = [r["reward_model"]["ground_truth"] for r in rows for _ in range(n)]
    flat = [repeat_score("ballast/repeat", text, truth)["score"] for text, truth in zip(responses, truths)]
    return np.array(flat).reshape(len(rows), n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (GRPO group size)")
    parser.add_argument("--max-response-length", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf", action="store_true", help="also sample the random-init tiny model")
    args = parser.parse_args(argv)
    model_dir = tiny_model_dir()
    tokenizer = load_tokenizer(model_dir)
    rows = make_repeat_rows(args.num_prompts, seed=args.seed, split="probe")
    rng = np.random.default_rng(args.seed)
    uniform = uniform_policy_scores(tokenizer, rows, args.n, args.max_response_length, rng)
    print(json.dumps(summarise("uniform_tokens", uniform)))
    if args.hf:
        sampled = model_policy_scores(model_dir, tokenizer, rows, args.n, args.max_response_length, args.seed)
        print(json.dumps(summarise("random_init_tiny_model", sampled)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
