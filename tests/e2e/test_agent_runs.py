"""Tool-agent runs through the whole driver loop (tools declared in a yaml) report their agent metrics,
validation too, and run rollout correction (the rollout's log-probs of the sampled tokens equal the actor's). The tiny
random model writes no tool calls, so tool tokens inside a response are covered below this level:
tests/unit/agent_loop/test_rollout_correction_alignment.py (no correction reads a masked tool token)
and tests/distributed/vllm/test_vllm_async.py (multi-turn rollout log-probs equal teacher-forced ones)."""

import math
import os

import pytest


AGENT_METRICS = ["agent/num_turns/mean", "agent/num_turns/max", "agent/tool_calls/total", "agent/tool_errors/total",
                 "agent/tool_timeouts/total", "agent/tool_latency_s/mean", "agent/stop_reason/answer",
                 "agent/stop_reason/length", "response_length/model_tokens/mean", "response_length/tool_tokens/mean",
                 "agent/tokenization_mismatch/frac"]
RC_METRICS = ["rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/rollout_is_mean",
              "rollout_corr/rollout_rs_masked_fraction", "training/rollout_actor_log_prob_diff/max"]


def test_tool_agent_run_reports_agent_metrics_and_corrects_rollouts(session, tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: calculator\n    config: {type: native, timeout_s: 5}\n"
                     "  - class_name: python\n    config: {type: native, timeout_s: 5}\n")
    extra = ["actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.enable=True",
             "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",  # the tiny task's rows name no loop
             f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
             "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3", "trainer.test_freq=2",
             "actor_rollout_ref.rollout.agent.max_concurrent_conversations=4",
             "actor_rollout_ref.rollout.calculate_log_probs=True", "+algorithm/rollout_correction=decoupled_token_is",
             "algorithm.rollout_correction.rollout_rs=seq_max_k3", "algorithm.rollout_correction.rollout_rs_threshold=5.0",
             # asserts what extra_info holds (training and validation) and returns what it saw
             f"custom_reward_function.path={os.path.join(os.path.dirname(__file__), 'agent_extra_info_reward.py')}"]
    with session("tools", *extra) as trainer:
        metrics = trainer.fit()
    assert metrics["reward_extra/seen_num_turns/mean"] == pytest.approx(metrics["agent/num_turns/mean"])
    assert metrics["reward_extra/seen_tool_calls/mean"] == pytest.approx(metrics["agent/tool_calls/mean"])
    missing = [k for k in AGENT_METRICS + ["val/" + k for k in AGENT_METRICS] if k not in metrics]
    assert not missing, missing
    assert all(math.isfinite(metrics[k]) for k in AGENT_METRICS)
    reasons = sum(metrics[f"agent/stop_reason/{r}"] for r in ("answer", "length", "max_assistant_turns",
                                                              "max_user_turns"))
    assert reasons == pytest.approx(1.0)
    assert metrics["agent/tokenization_mismatch/frac"] == 0.0
    corr = [k for k in RC_METRICS if not math.isfinite(metrics.get(k, math.nan))]
    assert not corr, corr
    assert metrics["training/rollout_actor_log_prob_diff/max"] < 1e-3
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0 and metrics["rollout_corr/kl"] < 1e-4
