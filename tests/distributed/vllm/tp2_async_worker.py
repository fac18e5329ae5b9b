"""One rank of the real TP=2 async-rollout test (run as a script by test_vllm_tp_async.py, never by pytest).

Each rank: gloo world, the TP engine (external_launcher), an AgentLoopRunner, then
  1. single-turn async (sampled) on this rank's own prompts, and batched `tp_generate` on the same;
  2. a multi-turn loop (sampled turns with inserted tokens between them) on this rank's prompts, and
     the engine's teacher-forced log-probs of every resulting sequence of the group (in lockstep);
  3. a call the leader cannot run (an unknown agent_name on its rows only): both ranks must raise.
Results go to <out_dir>/rank<k>.pt; the parent test asserts on them.
"""

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from testkit.agent import register_inserting_loop  # noqa: E402
from testkit.prompts import left_padded_prompts  # noqa: E402

PROMPTS = {0: [[5, 6, 7], [9], [10, 11, 12, 13]], 1: [[20, 21, 22, 23], [9], [30], [31, 32], [40, 41, 42, 43]]}


def main(model_dir, out_dir):
    from ballast.protocol import Batch
    from ballast.workers.agent_loop import AgentLoopRunner, AgentLoopSpec
    from ballast.workers.agent_loop.tp import tp_agent_generate
    from ballast.workers.rollout import RolloutConfig, SamplingConfig, build_backend, new_tp_group, tp_generate

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    sampling = SamplingConfig(max_response_length=32, seed=5, calculate_log_probs=True)
    cfg = RolloutConfig(model_path=model_dir, backend="vllm", device="cpu", max_model_len=96,
                        kv_cache_memory_bytes=32 << 20, max_num_seqs=16, tensor_model_parallel_size=2,
                        sampling=sampling)
    backend = build_backend(cfg)
    group = new_tp_group(2)
    register_inserting_loop()
    runner = AgentLoopRunner(backend, AgentLoopSpec(tokenizer_path=model_dir, prompt_length=8, response_length=32))
    prompts = left_padded_prompts(PROMPTS[rank], position_ids=True)
    result = {"input": prompts.to_dict()}
    result["async"] = tp_agent_generate(runner, Batch(prompts), group, sampling, call_index=4).tensors.to_dict()
    result["batched"] = tp_generate(backend, prompts, group, sampling, call_index=4).to_dict()
    multi = Batch(prompts, non_tensors={"agent_name": ["test_inserting_agent"] * len(PROMPTS[rank])})
    out = tp_agent_generate(runner, multi, group, dataclasses.replace(sampling, ignore_eos=True), call_index=7)
    result["multi"] = out.tensors.to_dict()
    result["multi_turns"] = out.columns["agent_num_turns"].tolist()
    mine = [out.tensors["input_ids"][i][out.tensors["attention_mask"][i].bool()].tolist()
            for i in range(len(PROMPTS[rank]))]
    everyone = [None, None]
    dist.all_gather_object(everyone, mine)
    teacher = backend.prompt_log_probs(everyone[0] + everyone[1])  # in lockstep on both ranks
    result["teacher"] = teacher[:3] if rank == 0 else teacher[3:]
    bad = Batch(prompts, non_tensors={"agent_name": ["no_such_loop" if rank == 0 else "single_turn_agent"]
                                      * len(PROMPTS[rank])})
    try:
        tp_agent_generate(runner, bad, group, sampling, call_index=9)
        result["error"] = None
    except (ValueError, RuntimeError) as err:
        result["error"] = f"{type(err).__name__}: {err}"
    result["alive"] = bool(dist.is_initialized())
    dist.barrier()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    backend.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
