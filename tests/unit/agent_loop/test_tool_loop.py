"""The tool loop is token-exact: sampled ids kept as sampled (mask 1, their log-probs), inserted ids
exactly the template's tool turn (mask 0, log-prob 0), and the whole sequence equal to the chat
template's rendering of the conversation; on the tiny Qwen2 tokenizer, SmolLM2's, and templates that
are not append-only."""

import asyncio
import json

import pytest

from ballast.tools import CalculatorTool
from ballast.workers.agent_loop import AgentSample, ChatFormat, StopReason, TemplateError, ToolAgentLoop
from testkit.agent import ScriptedEngine, make_context

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
QUESTIONS = {"q1": "What is 12 * 34?", "q2": "Say hi.", "q3": "What is 2 + 3 and 4 * 5?"}
SCRIPTS = {
    "q1": ["I will use the calculator. " + CALL % "12 * 34", "The answer is 408."],
    "q2": ["Hi!"],
    "q3": [CALL % "2 + 3" + "\n" + CALL % "4 * 5", "5 and 20."],
}


def run_rows(tokenizer, scripts=SCRIPTS, non_canonical=False, sanity_mode="strict", **kw):
    """Play every scripted conversation concurrently; (outputs by key, engine, context)."""
    keys = sorted(scripts)
    messages = {k: [{"role": "system", "content": "Use tools."}, {"role": "user", "content": QUESTIONS[k]}]
                for k in keys}
    chat = ChatFormat(tokenizer, sanity_mode=sanity_mode)
    prompts = {k: chat.prompt_ids(messages[k]) for k in keys}

    def key_of(ids):
        return next(k for k in keys if list(ids[: len(prompts[k])]) == prompts[k])

    engine = ScriptedEngine(tokenizer, scripts, key_of, tokenizer.eos_token_id, non_canonical=non_canonical)
    kw.setdefault("max_parallel_calls", 2)
    ctx = make_context(engine, tokenizer, {"calculator": CalculatorTool()}, sanity_mode=sanity_mode, **kw)
    loop = ToolAgentLoop(ctx)

    async def main():
        return await asyncio.gather(*(loop.run(AgentSample(i, prompts[k], messages[k])) for i, k in enumerate(keys)))

    return dict(zip(keys, asyncio.run(main()))), engine, ctx


def check_token_exact(out, engine, key, chat):
    sampled = [t for ids, _ in engine.sampled[key] for t in ids]
    lps = [x for _, lp in engine.sampled[key] for x in lp]
    mask = out.response_mask
    assert [t for t, m in zip(out.response_ids, mask) if m] == sampled
    assert [x for x, m in zip(out.log_probs, mask) if m] == lps
    assert all(x == 0.0 for x, m in zip(out.log_probs, mask) if not m)
    # every turn was asked to continue exactly the sequence built so far
    for request, _ in (c for c in engine.calls if engine.key_of(c[0].prompt_ids) == key):
        n = len(request.prompt_ids) - len(out.prompt_ids)
        assert list(request.prompt_ids) == out.prompt_ids + out.response_ids[:n]
    return sampled


@pytest.mark.parametrize("non_canonical", [False, True])
def test_tool_conversations_are_token_exact_on_the_tiny_tokenizer(tiny_tokenizer, non_canonical):
    outs, engine, ctx = run_rows(tiny_tokenizer, non_canonical=non_canonical)
    chat = ctx.chat
    for key, out in outs.items():
        check_token_exact(out, engine, key, chat)
        assert out.info["tokenization_mismatch"] == 0.0, key
        assert out.stop_reason == StopReason.ANSWER
    q1 = outs["q1"]
    inserted = [t for t, m in zip(q1.response_ids, q1.response_mask) if not m]
    assert chat.decode(inserted) == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    assert q1.num_turns == 4 and q1.info["tool_calls"] == 1 and q1.info["tool_errors"] == 0
    q3 = outs["q3"]
    assert chat.decode([t for t, m in zip(q3.response_ids, q3.response_mask) if not m]) == (
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>tool\n20<|im_end|>\n<|im_start|>assistant\n")
    if non_canonical:  # the sampled split is kept, not re-tokenised into the tokenizer's own
        canonical = chat.encode(chat.decode(q1.prompt_ids + q1.response_ids))
        assert canonical != q1.prompt_ids + q1.response_ids


def test_tool_conversations_are_token_exact_on_smollm2s_tokenizer(smollm2_dir):
    from ballast.models import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    for non_canonical in (False, True):
        outs, engine, ctx = run_rows(tokenizer, non_canonical=non_canonical)
        for key, out in outs.items():
            check_token_exact(out, engine, key, ctx.chat)
            assert out.info["tokenization_mismatch"] == 0.0
    ChatFormat(tokenizer).probe(tokenizer.eos_token)


def test_the_response_budget_ends_a_conversation_before_tool_tokens_overflow_it(tiny_tokenizer):
    outs, engine, _ = run_rows(tiny_tokenizer, {"q1": SCRIPTS["q1"]}, response_length=40)
    out = outs["q1"]
    assert out.stop_reason == StopReason.LENGTH and len(out.response_ids) <= 40
    assert len(engine.sampled["q1"]) == 1  # the tool turn did not fit: no second turn
    assert all(out.response_mask)  # nothing inserted


def test_turn_limits_end_conversations_with_their_reason(tiny_tokenizer):
    loops = {"q1": [SCRIPTS["q1"][0]] * 5}
    outs, _, _ = run_rows(tiny_tokenizer, loops, max_assistant_turns=2)
    assert outs["q1"].stop_reason == StopReason.MAX_ASSISTANT_TURNS and outs["q1"].info["assistant_turns"] == 2
    outs, _, _ = run_rows(tiny_tokenizer, loops, max_user_turns=3)
    assert outs["q1"].stop_reason == StopReason.MAX_USER_TURNS and outs["q1"].info["tool_calls"] == 3


def _template_tokenizer(tokenizer, template):
    import copy

    clone = copy.deepcopy(tokenizer)
    clone.chat_template = template
    return clone


# Drops the reasoning of earlier assistant turns, as Qwen3/DeepSeek-R1 style templates do.
DROP_THINKING = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not loop.last and '</think>' in m['content'] -%}"
    "{{- '<|im_start|>assistant\\n' + m['content'].split('</think>')[-1] + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
# Writes the message count in a header: every appended message rewrites the start of the text.
COUNTING = "{{- 'messages: ' + (messages|length|string) + '\\n' -}}" + DROP_THINKING
# Trims message contents.
TRIMMING = DROP_THINKING.replace("m['content'] + '<|im_end|>", "m['content']|trim + '<|im_end|>")


def test_a_template_that_rewrites_earlier_turns_is_caught_per_sample_and_the_sampled_ids_kept(tiny_tokenizer):
    tok = _template_tokenizer(tiny_tokenizer, DROP_THINKING)
    scripts = {"q1": ["<think>I should compute it.</think>" + CALL % "12 * 34", "408"]}
    ChatFormat(tok).probe(tok.eos_token)  # the synthetic probe has no reasoning: it passes
    outs, engine, ctx = run_rows(tok, scripts)
    sampled = check_token_exact(outs["q1"], engine, "q1", ctx.chat)
    assert "<think>" in ctx.chat.decode(sampled)
    assert outs["q1"].info["tokenization_mismatch"] == 1.0
    outs, _, _ = run_rows(tok, scripts, sanity_mode="disable")
    assert outs["q1"].info["tokenization_mismatch"] == 0.0


def test_a_template_that_is_not_append_only_fails_at_start_up_unless_the_check_is_disabled(tiny_tokenizer):
    tok = _template_tokenizer(tiny_tokenizer, COUNTING)
    for mode in ("strict", "ignore_strippable"):
        with pytest.raises(TemplateError, match="messages: ' ?: sequence '2' vs template '5'.*not append-only"):
            ChatFormat(tok, sanity_mode=mode).probe(tok.eos_token)
    ChatFormat(tok, sanity_mode="disable").probe(tok.eos_token)
    no_tools = _template_tokenizer(tiny_tokenizer, "{%- for m in messages -%}{%- if m['role'] == 'tool' -%}"
                                   "{{ raise_exception('no tools') }}{%- endif -%}{{- m['content'] -}}{%- endfor -%}")
    with pytest.raises(TemplateError, match="failed on roles"):
        ChatFormat(no_tools, sanity_mode="disable").probe(tok.eos_token)


def test_whitespace_only_differences_pass_only_under_ignore_strippable(tiny_tokenizer):
    tok = _template_tokenizer(tiny_tokenizer, TRIMMING)
    scripts = {"q2": ["  Hi!  "]}
    outs, _, _ = run_rows(tok, scripts, sanity_mode="strict")
    assert outs["q2"].info["tokenization_mismatch"] == 1.0
    outs, _, _ = run_rows(tok, scripts, sanity_mode="ignore_strippable")
    assert outs["q2"].info["tokenization_mismatch"] == 0.0
    # A template ending the LAST message with an extra newline: the closing read off a synthetic
    # conversation (where the assistant turn is last) is one newline longer than mid-conversation.
    tok = _template_tokenizer(tiny_tokenizer, DROP_THINKING.replace(
        "'<|im_end|>\\n' -}}{%- endif -%}", "'<|im_end|>\\n' + ('\\n' if loop.last else '') -}}{%- endif -%}"))
    assert ChatFormat(tok).render([{"role": "user", "content": "x"}]).endswith("<|im_end|>\n\n")
    with pytest.raises(TemplateError, match="ignore_strippable"):
        ChatFormat(tok, sanity_mode="strict").probe(tok.eos_token)
    ChatFormat(tok, sanity_mode="ignore_strippable").probe(tok.eos_token)


def test_hermes_parsing():
    from ballast.workers.agent_loop.hermes import parse_hermes

    text = ('a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b <tool_call>{"name": "g", '
            '"arguments": "{\\"y\\": 2}"}</tool_call><tool_call>not json</tool_call><tool_call>[1]</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call> <tool_call>{"name": "h"')
    rest, calls = parse_hermes(text)
    assert rest.startswith("a  b ")
    assert [(c.name, c.arguments) for c in calls[:2]] == [("f", {"x": 1}), ("g", {"y": 2})]
    assert [c.error is not None for c in calls] == [False, False, True, True, True, True]
    assert json.loads('{"ok": 1}')  # the module does not replace json
