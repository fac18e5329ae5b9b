"""Agent loops on request-level rollout: how every rollout call generates (`rollout.mode` sync or async).

    runner = AgentLoopRunner(backend, AgentLoopSpec(tokenizer_path=..., prompt_length=...,
                                                    multi_turn=MultiTurnConfig(tool_config_path="tools.yaml")))
    result = runner.generate(prompts_batch, sampling, call_index)    # output contract + agent columns

Loops: `single_turn_agent` (the batched rollout, token for token: the default) and `tool_agent`
(hermes tool calls over several turns); more with `@register(name)` or `agent_loop_config_path`. See `base.py`
for the interface, `chat.py` for how sequences stay token-exact, `output.py` for the layout and
`metrics.py` for the step metrics.
"""

from ballast.workers.agent_loop.base import (
    STOP_REASONS, AgentContext, AgentLoop, AgentLoopOutput, AgentSample, StopReason, Transcript, register,
    registered_loops,
)
from ballast.workers.agent_loop.chat import ChatFormat, TemplateError
from ballast.workers.agent_loop.config import AgentLoopSpec, MultiTurnConfig
from ballast.workers.agent_loop.loops import SingleTurnAgentLoop, ToolAgentLoop
from ballast.workers.agent_loop.output import AgentRollout
from ballast.workers.agent_loop.runner import AgentLoopRunner

__all__ = [
    "STOP_REASONS", "AgentContext", "AgentLoop", "AgentLoopOutput", "AgentLoopRunner", "AgentLoopSpec", "AgentRollout",
    "AgentSample", "ChatFormat", "MultiTurnConfig", "SingleTurnAgentLoop", "StopReason", "TemplateError",
    "ToolAgentLoop", "Transcript", "register", "registered_loops",
]
