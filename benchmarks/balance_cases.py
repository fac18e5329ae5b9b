"""The seeded cases of ``benchmarks/balance_bench.py``: model shapes, length distributions and sizes.

A case is a length distribution (prompt + response tokens per sample), a size (N samples, dp ranks,
per-micro-batch token budget) and a model whose forward FLOPs are a sample's cost. Seeds:
``seed_base + seed_offset + 10 * distribution index + size index`` (see :func:`build_cases`).
"""

from __future__ import annotations

import numpy as np

from ballast.balance import FlopsModel

MODELS = {
    # Numbers from the public config.json files of Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-7B.
    "qwen2.5-0.5b": FlopsModel(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                               intermediate_size=4864, vocab_size=151936),
    "qwen2.5-7b": FlopsModel(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                             intermediate_size=18944, vocab_size=152064),
}
SIZES = [(1024, 8, 16384), (4096, 32, 32768), (8192, 64, 32768)]


def _uniform(rng: np.random.Generator, n: int, max_len: int) -> np.ndarray:
    return rng.integers(256, min(8192, max_len) + 1, n)


def _lognormal(rng: np.random.Generator, n: int, max_len: int) -> np.ndarray:
    """Prompt + a long-tailed response truncated at an RL config's max_response_length (budget/2 - 1024)."""
    prompt = rng.integers(64, 1025, n)
    response = np.exp(rng.normal(np.log(1024), 1.0, n)).astype(np.int64)
    return prompt + np.clip(response, 1, max_len // 2 - 1024)


def _lognormal_untruncated(rng: np.random.Generator, n: int, max_len: int) -> np.ndarray:
    """Stress case: the same tail cut only at the budget, so a rare sample fills a micro-batch alone."""
    prompt = rng.integers(64, 1025, n)
    response = np.exp(rng.normal(np.log(1024), 1.0, n)).astype(np.int64)
    return np.clip(prompt + response, 32, max_len)


def _bimodal(rng: np.random.Generator, n: int, max_len: int) -> np.ndarray:
    short = rng.normal(700, 200, n)
    long = rng.normal(7000, 2000, n)
    return np.clip(np.where(rng.random(n) < 0.6, short, long).astype(np.int64), 32, max_len)


def _longctx(rng: np.random.Generator, n: int, max_len: int) -> np.ndarray:
    return np.clip(np.exp(rng.normal(np.log(8192), 0.6, n)).astype(np.int64), 1024, min(32768, max_len))


def _longctx_few(rng: np.random.Generator, n: int, max_len: int) -> np.ndarray:
    """Long context with few samples per rank: log-normal, median 20k, sigma 0.8, within 1024..budget."""
    return np.clip(np.exp(rng.normal(np.log(20000), 0.8, n)).astype(np.int64), 1024, max_len)


def _grpo_pareto(rng: np.random.Generator, n: int, max_len: int) -> np.ndarray:
    """GRPO groups of 8 responses sharing a prompt (64..1024 tokens); Pareto(1.2) responses, scale
    200, truncated at 15000 tokens."""
    prompt = rng.integers(64, 1025, n // 8).repeat(8)
    response = np.minimum((rng.pareto(1.2, n) + 1.0) * 200.0, 15000).astype(np.int64)
    return np.minimum(prompt + response, max_len)


def _truncation_spike(rng: np.random.Generator, n: int, max_len: int) -> np.ndarray:
    """The log-normal case with 30% of the responses cut at max_response_length (budget/2 - 1024)."""
    tokens = _lognormal(rng, n, max_len)
    prompt = rng.integers(64, 1025, n)
    spike = rng.random(n) < 0.3
    return np.where(spike, prompt + max_len // 2 - 1024, tokens)


def _all_equal(rng: np.random.Generator, n: int, max_len: int) -> np.ndarray:
    return np.full(n, min(4096, max_len), dtype=np.int64)


def _one_at_budget(rng: np.random.Generator, n: int, max_len: int) -> np.ndarray:
    """Tiny samples (16..256 tokens) and one exactly at the budget."""
    tokens = rng.integers(16, 257, n)
    tokens[rng.integers(n)] = max_len
    return tokens


DISTRIBUTIONS = {"uniform": _uniform, "lognormal": _lognormal, "bimodal": _bimodal, "longctx": _longctx}
# Distributions added later, each with its own sizes (N, dp, budget); seeds 2000 + 10 * index + size index.
NEW_DISTRIBUTIONS = {
    "longctx_few": (_longctx_few, [(256, 32, 131072), (128, 16, 32768), (512, 64, 65536)]),
    "grpo_pareto": (_grpo_pareto, [(1024, 8, 16384)]),
    "truncation_spike": (_truncation_spike, SIZES),
    "all_equal": (_all_equal, SIZES),
    "n_equals_dp": (_lognormal, [(64, 64, 32768), (8, 8, 16384)]),
    "one_at_budget": (_one_at_budget, [(1024, 8, 16384), (4096, 32, 32768)]),
}
# The GRPO case again with each prompt's group kept on one rank (trainer.balance_keep_groups);
# verl keeps groups with its prefix-grouper path (Karmarkar-Karp over groups), which the bench runs for it.
GROUPED = {"grpo_pareto_groups": (_grpo_pareto, [(1024, 8, 16384)])}
STRESS_DISTRIBUTIONS = {"lognormal_untruncated": _lognormal_untruncated}


def build_cases(quick: bool, distributions: dict = DISTRIBUTIONS, seed_offset: int = 0, seed_base: int = 1000,
                groups: bool = False):
    """Seed of a case: ``seed_base + seed_offset + 10 * distribution index + size index``."""
    for d_index, (dist, entry) in enumerate(distributions.items()):
        sampler, sizes = entry if isinstance(entry, tuple) else (entry, SIZES)
        for s_index, (n, dp, budget) in enumerate(sizes[:1] if quick else sizes):
            rng = np.random.default_rng(seed_base + seed_offset + 10 * d_index + s_index)
            tokens = sampler(rng, n, budget).astype(np.int64)
            uids = np.arange(n) // 8 if groups else None
            for model_name, model in MODELS.items():
                yield f"{dist}/N={n},dp={dp},budget={budget}/{model_name}", tokens, dp, budget, model, uids
