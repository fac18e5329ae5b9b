"""Rollout throughput on CPU: vLLM backend vs HF backend, same tiny model, same prompts.

64 prompts x 64 new tokens by default, sampling at temperature 1 with ignore_eos so both backends
generate exactly that many tokens, each call through the rollout's one generate path (single-turn
agent loops on the backend's request-level core, as the rollout worker runs them); one warm-up call per backend is excluded; tokens/s uses the
fastest of --repeats timed calls (the least disturbed by other processes on a shared machine; the
median is reported too). One thread, as a colocated trainer process would use.

    python benchmarks/rollout_bench.py --json out.json
prints {"vllm_tokens_per_s", "hf_tokens_per_s", "ratio" (vllm / hf), ...settings and machine}.
"""

from __future__ import annotations

import os
import sys

# The rollout tests' model builder lives in tests/testkit, outside the installed package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

# Before torch/vllm are imported: one thread, in-process engine, caches kept inside the run.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_model  # noqa: E402


def make_prompts(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_prompts,), generator=gen)
    width = int(lengths.max())
    ids = torch.zeros((num_prompts, width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths.tolist()):
        ids[i, width - n:] = torch.randint(2, vocab_size, (n,), generator=gen)
        mask[i, width - n:] = 1
    return TensorDict(input_ids=ids, attention_mask=mask, batch_size=[num_prompts])


def time_backend(backend, prompts: TensorDict, sampling, repeats: int) -> tuple[float, float, int]:
    """(fastest, median) seconds per generate call after one warm-up, and the tokens per call."""
    from ballast.protocol import Batch
    from ballast.workers.agent_loop import AgentLoopRunner

    runner = AgentLoopRunner(backend)
    runner.generate(Batch(prompts), sampling)
    seconds, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        out = runner.generate(Batch(prompts), sampling).tensors
        seconds.append(time.perf_counter() - start)
        tokens = int(out["response_mask"].sum())
    return min(seconds), statistics.median(seconds), tokens


def _model_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def _vocab_size(model_dir: str) -> int:
    return int(_model_config(model_dir)["vocab_size"])


def _model_summary(model_dir: str) -> str:
    c = _model_config(model_dir)
    return (f"hidden={c['hidden_size']} layers={c['num_hidden_layers']} heads={c['num_attention_heads']} "
            f"vocab={c['vocab_size']} tied={c.get('tie_word_embeddings', False)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the result here as JSON")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small", "rollout-test"],
                        help="tiny/small: ballast.models' cached models; rollout-test: the rollout tests' model")
    parser.add_argument("--model-dir", help="an existing HF model directory instead of a preset")
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend
    from testkit.models import build_tiny_qwen2

    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir:
            model_dir, model_name = args.model_dir, args.model_dir
        elif args.preset == "rollout-test":
            model_dir, model_name = build_tiny_qwen2(os.path.join(tmp, "model")), "rollout-test random Qwen2"
        else:
            from ballast.models import tiny_model_dir

            model_dir, model_name = str(tiny_model_dir(args.preset)), f"ballast.models {args.preset}"
        vocab_size = _vocab_size(model_dir)
        prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab_size, 0)
        sampling = SamplingConfig(max_response_length=args.new_tokens, temperature=1.0, seed=0, ignore_eos=True)
        expected_tokens = args.num_prompts * args.new_tokens
        common = dict(model_path=model_dir, device="cpu", sampling=sampling,
                      max_model_len=args.max_prompt_len + args.new_tokens + 1)

        hf = build_backend(RolloutConfig(backend="hf", **common))
        hf_s, hf_median_s, hf_tokens = time_backend(hf, prompts, sampling, args.repeats)
        hf.shutdown()
        vllm = build_backend(RolloutConfig(backend="vllm", kv_cache_memory_bytes=256 << 20,
                                           max_num_seqs=args.num_prompts, **common))
        vllm_s, vllm_median_s, vllm_tokens = time_backend(vllm, prompts, sampling, args.repeats)
        vllm.shutdown()
    if hf_tokens != expected_tokens or vllm_tokens != expected_tokens:
        raise RuntimeError(f"expected {expected_tokens} tokens per call, got hf={hf_tokens} vllm={vllm_tokens}")

    import vllm as vllm_pkg

    result = {
        "vllm_tokens_per_s": expected_tokens / vllm_s,
        "hf_tokens_per_s": expected_tokens / hf_s,
        "ratio": hf_s / vllm_s,
        "vllm_seconds_per_call": {"fastest": vllm_s, "median": vllm_median_s},
        "hf_seconds_per_call": {"fastest": hf_s, "median": hf_median_s},
        "num_prompts": args.num_prompts,
        "new_tokens": args.new_tokens,
        "prompt_len_range": [args.min_prompt_len, args.max_prompt_len],
        "repeats": args.repeats,
        "threads": int(os.environ["OMP_NUM_THREADS"]),
        "model": f"{model_name} ({_model_summary(model_dir)}, float32)",
        "versions": {"torch": torch.__version__, "vllm": vllm_pkg.__version__},
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.platform()}",
        "load_average_1m": os.getloadavg()[0],
        "date": datetime.date.today().isoformat(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
