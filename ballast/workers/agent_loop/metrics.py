"""Step metrics of agent-loop rollouts, from the per-sample columns of `output.py` (pure; no Ray).

    agent/num_turns/{mean,max,min}        verl's count: model turns + tool turns + 1
    agent/assistant_turns/{mean,max}
    agent/tool_calls/{total,mean}         calls answered (run, or refused with an error message)
    agent/tool_errors/total, agent/tool_timeouts/total, agent/malformed_tool_calls/total,
    agent/unknown_tool_calls/total, agent/tool_calls_dropped/total (beyond max_parallel_calls)
    agent/tool_latency_s/{mean,max}       per call (mean over every call of the step)
    agent/stop_reason/<reason>            fraction of samples that ended for each reason
    agent/tokenization_mismatch/frac      samples whose sequence differs from the template rendering
    response_length/model_tokens/mean, response_length/tool_tokens/mean   the response split into
                                          sampled tokens and inserted (tool/user/template) tokens
Nothing is returned for a batch without agent columns (one built by hand).
"""

from __future__ import annotations

import numpy as np

from ballast.workers.agent_loop.base import STOP_REASONS


def agent_metrics(non_tensors: dict, prefix: str = "") -> dict[str, float]:
    """The metrics above from a batch's non-tensor columns; `prefix` e.g. "val/" for validation."""
    if "agent_stop_reason" not in non_tensors:
        return {}
    col = {k: np.asarray(v) for k, v in non_tensors.items() if k.startswith("agent_")}
    n = len(col["agent_stop_reason"])
    if n == 0:
        return {}
    out: dict[str, float] = {}
    turns = col["agent_num_turns"].astype(np.float64)
    out.update({"agent/num_turns/mean": turns.mean(), "agent/num_turns/max": turns.max(),
                "agent/num_turns/min": turns.min()})
    number = lambda key: col[f"agent_{key}"].astype(np.float64) if f"agent_{key}" in col else np.zeros(n)
    assistant = number("assistant_turns")
    out.update({"agent/assistant_turns/mean": assistant.mean(), "agent/assistant_turns/max": assistant.max()})
    calls = number("tool_calls")
    out["agent/tool_calls/total"] = calls.sum()
    out["agent/tool_calls/mean"] = calls.mean()
    out["agent/tool_use_frac"] = float((calls > 0).mean())
    for key in ("tool_errors", "tool_timeouts", "malformed_tool_calls", "unknown_tool_calls", "tool_calls_dropped"):
        out[f"agent/{key}/total"] = number(key).sum()
    out["agent/tool_latency_s/mean"] = number("tool_latency_s").sum() / calls.sum() if calls.sum() else 0.0
    out["agent/tool_latency_s/max"] = number("tool_latency_max_s").max()
    reasons = col["agent_stop_reason"].astype(str)
    for reason in STOP_REASONS:
        out[f"agent/stop_reason/{reason}"] = float((reasons == reason).mean())
    out["agent/tokenization_mismatch/frac"] = float((number("tokenization_mismatch") > 0).mean())
    out["response_length/model_tokens/mean"] = number("model_tokens").mean()
    out["response_length/tool_tokens/mean"] = number("tool_tokens").mean()
    return {prefix + k: float(v) for k, v in out.items()}
