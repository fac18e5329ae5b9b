"""Where vLLM's CPU generation spends the time a LoRA adapter adds: one rollout-sized generate call
(`--prompts` rows, `--tokens` new tokens each, EOS ignored so every row decodes alike) on a plain
engine, then on an engine serving a rank-`--rank` all-linear adapter (B non-zero), with the torch
profiler's op table of the adapter call.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vllm_lora_profile.py --json out.json

Reports the median seconds of `--repeats` calls per engine, the difference, and the ops that take
the most self CPU time in the adapter call, with their call counts (`ops`), so that per-call overhead
(many tiny calls) can be told from arithmetic (few large ones). On the adapter engine it then times,
interleaved, `--repeats` calls each of the whole-layer one-slot path (`vllm_internals`), vLLM's
per-slice path, and no adapter request (the LoRA layers with nothing to add), and checks that the
two paths sample the same tokens (`paths`). Engines in separate processes compare only loosely on a
shared box; the paths share one engine and one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def generate(backend, prompts, call_index: int):
    """One rollout call (single-turn agent loops on the engine's core, as the rollout worker runs it)."""
    from ballast.protocol import Batch
    from ballast.workers.agent_loop import AgentLoopRunner

    return AgentLoopRunner(backend).generate(Batch(prompts), call_index=call_index).tensors


def timed_calls(backend, prompts, repeats: int) -> list:
    generate(backend, prompts, call_index=0)  # warm-up
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        generate(backend, prompts, call_index=i + 1)
        times.append(time.perf_counter() - start)
    return times


def compare_paths(backend, prompts, repeats: int) -> dict:
    """Interleaved calls of the one-slot path, vLLM's per-slice path and no adapter request."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from ballast.workers.rollout import vllm_internals as ops

    one_slot, adapter_id = PunicaWrapperCPU.add_lora_linear, backend._adapter_id
    modes = {"one_slot": (one_slot, adapter_id), "per_slice": (ops._ORIGINAL["add_lora_linear"], adapter_id),
             "no_adapter_request": (one_slot, 0)}
    times = {name: [] for name in modes}
    same_tokens = True
    try:
        for i in range(repeats):
            outs = {}
            for name in (list(modes) if i % 2 == 0 else list(modes)[::-1]):
                PunicaWrapperCPU.add_lora_linear, backend._adapter_id = modes[name]
                start = time.perf_counter()
                outs[name] = generate(backend, prompts, call_index=200 + i)["responses"]
                times[name].append(time.perf_counter() - start)
            same_tokens &= bool((outs["one_slot"] == outs["per_slice"]).all())
    finally:
        PunicaWrapperCPU.add_lora_linear, backend._adapter_id = one_slot, adapter_id
    return {**{name: {"s_per_call": statistics.median(t), "all": t} for name, t in times.items()},
            "same_tokens_one_slot_vs_per_slice": same_tokens}


def main() -> None:
    from transformers import AutoModelForCausalLM

    from ballast.engine.config import LoraSpec
    from ballast.engine.lora import adapter_state, attach_adapter
    from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend
    from tensordict import TensorDict

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="default: ballast.models.from_gguf.real_model_dir('float32')")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-length", type=int, default=48)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json")
    args = p.parse_args()
    if args.model_dir is None:
        from ballast.models.from_gguf import real_model_dir

        args.model_dir = str(real_model_dir("float32"))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 40000, (args.prompts, args.prompt_length), generator=gen)
    prompts = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                          "position_ids": torch.arange(args.prompt_length).expand(args.prompts, -1).clone()},
                         batch_size=[args.prompts])
    sampling = SamplingConfig(max_response_length=args.tokens, do_sample=True, seed=0, ignore_eos=True)
    result = {"args": vars(args)}
    for name, rank in (("plain", None), ("adapter", args.rank)):
        backend = build_backend(RolloutConfig(model_path=args.model_dir, backend="vllm", device="cpu",
                                              max_model_len=256, max_num_seqs=args.prompts, sampling=sampling,
                                              kv_cache_memory_bytes=256 << 20, max_lora_rank=rank))
        if rank is not None:
            model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
            adapter = attach_adapter(model, LoraSpec(rank=rank, alpha=2 * rank), "actor", seed=0)
            with torch.no_grad():
                for n, t in model.named_parameters():
                    if ".lora_B." in n:
                        t.normal_(0, 0.01, generator=gen)
            backend.load_adapter(adapter_state(model.state_dict().items()), adapter.config_dict())
        times = timed_calls(backend, prompts, args.repeats)
        result[name] = {"s_per_call": statistics.median(times), "all": times}
        if rank is not None:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                generate(backend, prompts, call_index=99)
            table = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
            result["ops"] = [{"op": e.key, "calls": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6} for e in table]
            result["profiled_calls_total"] = sum(e.count for e in prof.key_averages())
            result["paths"] = compare_paths(backend, prompts, args.repeats)
            print(json.dumps({"paths": result["paths"]}), flush=True)
        backend.shutdown()
        print(json.dumps({name: result[name]}), flush=True)
    result["adapter_extra_s"] = result["adapter"]["s_per_call"] - result["plain"]["s_per_call"]
    for row in result.get("ops", []):
        print(f"{row['op'][:60]:60s} {row['calls']:8d} {row['self_cpu_s']:8.3f} s")
    print(json.dumps({k: result[k] for k in ("adapter_extra_s", "profiled_calls_total")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
