"""One rank of the real TP=2 vLLM rollout test (run as a script by test_vllm_tp.py, never by pytest).

Each rank: gloo world first, then the TP engine (external_launcher), then
  1. tp_generate on this rank's own prompts (counts and widths differ between ranks);
  2. references: the same engine on each rank's prompts alone (both ranks, in lockstep);
  3. a sampled generate of the same batch on both ranks (the ranks must draw the same tokens);
  4. weight sync from an FSDP2-sharded copy of the model after one AdamW step, comparing vLLM's
     prompt log-probs with the FSDP model's own forward.
Results go to <out_dir>/rank<k>.pt; the parent test asserts on them.
"""

import os
import sys

import torch
import torch.distributed as dist

# Run as a script: the shared prompt builder is in tests/testkit.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from testkit.prompts import left_padded_prompts  # noqa: E402

# Per-rank prompts: rank 0 has 3 short prompts, rank 1 has 5 wider ones; [9] appears on both.
PROMPTS = {
    0: [[5, 6, 7], [9], [10, 11, 12, 13]],
    1: [[20, 21, 22, 23, 24, 25], [9], [30], [31, 32], [40, 41, 42, 43, 44, 45, 46]],
}
RESPONSE_TOKENS = 10


def make_prompts(token_lists, extra_width=0):
    return left_padded_prompts(token_lists, max(len(t) for t in token_lists) + extra_width)


def fsdp_weight_sync(backend, model_dir, rank):
    """One AdamW step on an FSDP2 model, stream its full weights into vLLM, compare log-probs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from ballast.workers.rollout import iter_full_tensors, load_weights

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    seq = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])
    loss = model(input_ids=seq, labels=seq, use_cache=False).loss
    loss.backward()
    optim.step()
    with torch.no_grad():
        logits = model(input_ids=seq, use_cache=False).logits[0, :-1]
    target = torch.log_softmax(logits.float(), -1).gather(1, seq[0, 1:, None])[:, 0]
    before = backend.prompt_log_probs([seq[0].tolist()])[0]
    count = load_weights(backend, iter_full_tensors(model))
    after = backend.prompt_log_probs([seq[0].tolist()])[0]
    return {"target": target, "before": before, "after": after, "count": count,
            "num_state": len(model.state_dict())}


def main(model_dir: str, out_dir: str) -> None:
    from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend, new_tp_group, tp_generate

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    greedy = SamplingConfig(max_response_length=RESPONSE_TOKENS, do_sample=False, eos_token_ids=(),
                            calculate_log_probs=True)
    cfg = RolloutConfig(
        model_path=model_dir, backend="vllm", device="cpu", max_model_len=64, kv_cache_memory_bytes=32 << 20,
        max_num_seqs=16, tensor_model_parallel_size=2, sampling=greedy,
    )
    backend = build_backend(cfg)  # every rank at the same time: construction is collective
    group = new_tp_group(2)
    result = {"engine_tp_ranks": backend.tp_group_ranks, "group_ranks": dist.get_process_group_ranks(group)}

    mine = make_prompts(PROMPTS[rank], extra_width=rank)  # the widths differ between ranks
    result["input"] = mine
    result["output"] = tp_generate(backend, mine, group, greedy).to_dict()
    result["gathered_digest"] = backend.last_input_digest
    result["alone"] = [backend.generate(make_prompts(PROMPTS[r]), greedy).to_dict() for r in (0, 1)]

    sampled = SamplingConfig(max_response_length=RESPONSE_TOKENS, temperature=1.0, seed=7, eos_token_ids=(),
                             calculate_log_probs=True)
    result["sampled"] = backend.generate(make_prompts(PROMPTS[0] + PROMPTS[1]), sampled).to_dict()
    result["weight_sync"] = fsdp_weight_sync(backend, model_dir, rank)
    result["default_group_alive_after_generate"] = dist.is_initialized()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    # Last act of the process: shutting the engine down also destroys the default process group.
    backend.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
