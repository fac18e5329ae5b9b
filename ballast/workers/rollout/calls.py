"""The engine-independent ends of a backend's `generate`: opening a call and closing it.

Every backend starts a call the same way (shared checks, numbering, the ids that end a response)
and ends it the same way (its responses and log-probs into the output contract of
`postprocess.py`); only the generation in between is engine specific. Keeping both ends here means
a rule such as "pad to `max_response_length` only when asked" is stated once for all backends.
"""

from __future__ import annotations

from collections.abc import Sequence

from tensordict import TensorDict

from .base import GenerateCall, SamplingConfig, start_generate_call, stop_ids_for
from .postprocess import build_rollout_output


def open_call(
    backend, prompts: TensorDict, sampling: SamplingConfig | None, call_index: int | None
) -> tuple[GenerateCall, tuple[int, ...]]:
    """`start_generate_call` plus the ids that end a response under the call's sampling."""
    call = start_generate_call(backend, prompts, sampling, call_index)
    return call, stop_ids_for(call.sampling, backend.eos_token_ids)


def close_call(
    backend,
    call: GenerateCall,
    stop: Sequence[int],
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]] | None,
) -> TensorDict:
    """The output contract for `call` from the engine's generated ids (and log-probs, if recorded)."""
    sampling = call.sampling
    return build_rollout_output(
        call.input_ids,
        call.attention_mask,
        call.position_ids,
        responses,
        log_probs,
        pad_token_id=backend.pad_token_id,
        stop_token_ids=stop,
        response_length=sampling.max_response_length if sampling.pad_to_max_response_length else None,
    )
