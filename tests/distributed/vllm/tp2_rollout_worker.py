"""One rank of the real TP=2 vLLM rollout tests (run as a script by test_vllm_tp.py, never by pytest).
One engine start serves every test of that file (a TP=2 vLLM start-up costs ~25 s on 2 cores).

Each rank: gloo world first, then the TP engine (external_launcher), then
  1. the TP group's rollout (an AgentLoopRunner with the group: the leader runs the conversations, the
     follower replays its engine steps) on this rank's own prompts (counts and widths differ between ranks);
  2. references: the same engine on each rank's prompts alone (both ranks, in lockstep, no group);
  3. a sampled call on the same batch on both ranks (the ranks must draw the same tokens);
  3b. the calls of tests/fixtures/same_tokens.json on this rank's recorded prompts, through the group's
     rollout, before any weight sync: the parent compares them with what the batched TP=2 rollout recorded;
  4. weight sync from an FSDP2-sharded copy of the model after one AdamW step, comparing vLLM's
     prompt log-probs with the FSDP model's own forward;
  5. agent loops on the synced engine: a multi-turn loop (sampled turns with inserted tokens between
     them) and the engine's teacher-forced log-probs of every resulting sequence of the group (in
     lockstep); last, a call the leader cannot run (an unknown agent_name on its rows only): both ranks
     must raise.
Results go to <out_dir>/rank<k>.pt ("async" holds step 5's, "same_tokens" step 3b's); the parent tests
assert on them.
"""

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

# Run as a script: the shared prompt builder and the test agent loop are in tests/testkit.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from testkit import same_tokens  # noqa: E402
from testkit.agent import register_inserting_loop  # noqa: E402
from testkit.prompts import left_padded_prompts  # noqa: E402
from testkit.rollout import generate  # noqa: E402

# Per-rank prompts: rank 0 has 3 short prompts, rank 1 has 5 wider ones; [9] appears on both.
PROMPTS = {
    0: [[5, 6, 7], [9], [10, 11, 12, 13]],
    1: [[20, 21, 22, 23, 24, 25], [9], [30], [31, 32], [40, 41, 42, 43, 44, 45, 46]],
}
RESPONSE_TOKENS = 10
# The async step's prompts (same width on both ranks: the agent loop's prompt length is fixed).
ASYNC_PROMPTS = {0: [[5, 6, 7], [9], [10, 11, 12, 13]], 1: [[20, 21, 22, 23], [9], [30], [31, 32], [40, 41, 42, 43]]}
ASYNC_RESPONSE_TOKENS = 32


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


def same_tokens_calls(backend, group, rank):
    """Step 3b: every recorded call on this rank's recorded prompts, through the group's rollout."""
    from ballast.workers.agent_loop import AgentLoopRunner

    fixture = same_tokens.load()
    generate_in_group = same_tokens.generate_with(AgentLoopRunner(backend, group=group))
    mine = fixture["prompts"]["tp2"][str(rank)]
    return {name: out.to_dict() for name, out in same_tokens.run_calls(fixture, generate_in_group, mine).items()}


def async_rollout(backend, group, model_dir, rank):
    """Step 5: async agent loops on the TP engine (see the module docstring)."""
    from ballast.protocol import Batch
    from ballast.workers.agent_loop import AgentLoopRunner, AgentLoopSpec
    from ballast.workers.rollout import SamplingConfig

    sampling = SamplingConfig(max_response_length=ASYNC_RESPONSE_TOKENS, seed=5, calculate_log_probs=True)
    register_inserting_loop()
    runner = AgentLoopRunner(backend, AgentLoopSpec(tokenizer_path=model_dir, prompt_length=8), group)
    prompts = left_padded_prompts(ASYNC_PROMPTS[rank], position_ids=True)
    result = {"input": prompts.to_dict()}
    multi = Batch(prompts, non_tensors={"agent_name": ["test_inserting_agent"] * len(ASYNC_PROMPTS[rank])})
    out = runner.generate(multi, dataclasses.replace(sampling, ignore_eos=True), call_index=7)
    result["multi"] = out.tensors.to_dict()
    result["multi_turns"] = out.columns["agent_num_turns"].tolist()
    mine = [out.tensors["input_ids"][i][out.tensors["attention_mask"][i].bool()].tolist()
            for i in range(len(ASYNC_PROMPTS[rank]))]
    everyone = [None, None]
    dist.all_gather_object(everyone, mine)
    teacher = backend.prompt_log_probs(everyone[0] + everyone[1])  # in lockstep on both ranks
    result["teacher"] = teacher[:len(everyone[0])] if rank == 0 else teacher[len(everyone[0]):]
    bad = Batch(prompts, non_tensors={"agent_name": ["no_such_loop" if rank == 0 else "single_turn_agent"]
                                      * len(ASYNC_PROMPTS[rank])})
    try:
        runner.generate(bad, sampling, call_index=9)
        result["error"] = None
    except (ValueError, RuntimeError) as err:
        result["error"] = f"{type(err).__name__}: {err}"
    result["alive"] = bool(dist.is_initialized())
    return result


def main(model_dir: str, out_dir: str) -> None:
    from ballast.protocol import Batch
    from ballast.workers.agent_loop import AgentLoopRunner
    from ballast.workers.agent_loop.tp import new_tp_group
    from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    greedy = SamplingConfig(max_response_length=RESPONSE_TOKENS, do_sample=False, eos_token_ids=(),
                            calculate_log_probs=True)
    cfg = RolloutConfig(
        model_path=model_dir, backend="vllm", device="cpu", max_model_len=96,
        kv_cache_memory_bytes=32 << 20, max_num_seqs=16, tensor_model_parallel_size=2, sampling=greedy,
    )
    backend = build_backend(cfg)  # every rank at the same time: construction is collective
    group = new_tp_group(2)
    result = {"engine_tp_ranks": backend.tp_group_ranks, "group_ranks": dist.get_process_group_ranks(group)}

    mine = make_prompts(PROMPTS[rank], extra_width=rank)  # the widths differ between ranks
    result["input"] = mine
    result["output"] = AgentLoopRunner(backend, group=group).generate(Batch(mine), greedy).tensors.to_dict()
    result["alone"] = [generate(backend, make_prompts(PROMPTS[r]), greedy).to_dict() for r in (0, 1)]

    sampled = SamplingConfig(max_response_length=RESPONSE_TOKENS, temperature=1.0, seed=7, eos_token_ids=(),
                             calculate_log_probs=True)
    result["sampled"] = generate(backend, make_prompts(PROMPTS[0] + PROMPTS[1]), sampled).to_dict()
    result["same_tokens"] = same_tokens_calls(backend, group, rank)
    result["engine"] = {"config": backend.config, "eos_token_ids": backend.eos_token_ids,
                        "pad_token_id": backend.pad_token_id}
    result["weight_sync"] = fsdp_weight_sync(backend, model_dir, rank)
    result["default_group_alive_after_generate"] = dist.is_initialized()
    result["async"] = async_rollout(backend, group, model_dir, rank)
    dist.barrier()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    # Last act of the process: shutting the engine down also destroys the default process group.
    backend.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
