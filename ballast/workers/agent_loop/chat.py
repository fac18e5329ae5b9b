"""The chat template as the agent loop uses it: tokens to insert between turns, and the sanity check.

Token-exact by construction. A conversation's training sequence is built by appending, never by
re-tokenising: the prompt's ids, then each turn's SAMPLED ids exactly as the engine returned them
(response_mask 1), then the ids of what the loop inserts (response_mask 0): the rest of the
template's closing of the assistant turn after the model's stop token (ChatML: the "\n" after
`<|im_end|>`), the new tool/user messages and the next generation prompt. The inserted text is read
off the template itself: render a short synthetic conversation ending in an assistant turn, render it
again with the new messages and the generation prompt, and take the difference (ValueError if the
second rendering does not start with the first: that template cannot be extended by appending).

The sanity check (`tokenization_sanity_check_mode`, verl's key): after a conversation, decode the
whole sequence and compare it with the template's rendering of the conversation's messages (the
assistant contents being the decoded sampled text). Equal text means the model was trained on what
the template would have shown it; a difference means the template is not append-only (e.g. it
rewrites earlier turns) or rewrites content. "strict" flags any difference, "ignore_strippable" only
differences that are not whitespace, "disable" skips the check. The sampled ids are never changed:
a model may sample a non-canonical tokenisation of its own text, and re-tokenising would train it
on tokens it did not sample. `probe` runs the check on a synthetic tool conversation when the worker
starts, so a template that fails it stops the run before the first step instead of being flagged in
every sample.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Literal

SanityMode = Literal["strict", "ignore_strippable", "disable"]
SANITY_MODES = ("strict", "ignore_strippable", "disable")
_SENTINEL = "<<ballast-turn-sentinel>>"
_SYNTHETIC = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


class TemplateError(ValueError):
    """The chat template cannot be used for multi-turn rollouts as configured."""


@dataclass(frozen=True)
class TextDiff:
    """Where the sampled sequence's text and the template's rendering differ: per differing span,
    (sequence text, rendered text, the 20 characters before it)."""

    chunks: tuple[tuple[str, str, str], ...]

    def only_whitespace(self) -> bool:
        return all(not a.strip() and not b.strip() for a, b, _ in self.chunks)

    def __str__(self) -> str:
        return "; ".join(f"after {c!r}: sequence {a!r} vs template {b!r}" for a, b, c in self.chunks[:4])


def text_diff(ours: str, expected: str) -> TextDiff | None:
    if ours == expected:
        return None
    matcher = difflib.SequenceMatcher(None, ours, expected, autojunk=False)
    chunks = tuple((ours[i1:i2], expected[j1:j2], ours[max(0, i1 - 20):i1])
                   for op, i1, i2, j1, j2 in matcher.get_opcodes() if op != "equal")
    return TextDiff(chunks)


class ChatFormat:
    """Renders and tokenises with one tokenizer and chat template (and its extra kwargs)."""

    def __init__(self, tokenizer, *, chat_template_kwargs: dict | None = None, sanity_mode: SanityMode = "strict"):
        if sanity_mode not in SANITY_MODES:
            raise TemplateError(f"tokenization_sanity_check_mode={sanity_mode!r} must be one of {SANITY_MODES}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError("the tokenizer has no chat template; multi-turn rollouts need one")
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self.sanity_mode = sanity_mode
        assistant = self.render(_SYNTHETIC + [{"role": "assistant", "content": _SENTINEL}])
        if _SENTINEL not in assistant:
            raise TemplateError("the chat template does not render an assistant message's content")
        # What the template writes after an assistant turn's content (ChatML: "<|im_end|>\n").
        self.assistant_closing = assistant[assistant.index(_SENTINEL) + len(_SENTINEL):]

    # ------------------------------------------------------------------ rendering
    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **self.kwargs)
        except Exception as err:  # jinja raises many types; say which roles failed
            raise TemplateError(f"the chat template failed on roles {[m.get('role') for m in messages]}: {err}") from err

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def normalize(self, text: str) -> str:
        """`text` as the tokenizer gives it back (e.g. NFC): message contents are kept in this form,
        so that the rendered conversation and the decoded sequence can be compared as text."""
        return self.decode(self.encode(text))

    def prompt_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    # ------------------------------------------------------------------ appending turns
    def closing_after(self, stop_text: str | None) -> str:
        """The part of the assistant closing the model did not sample: after its stop token's text when
        the closing starts with it (ChatML), else the whole closing; none after a length cut."""
        if stop_text is not None and self.assistant_closing.startswith(stop_text):
            return self.assistant_closing[len(stop_text):]
        return self.assistant_closing

    def insertion_text(self, messages: list[dict], stop_text: str | None, tools: list | None = None) -> str:
        """Text to append after a finished assistant turn to add `messages` and the next generation
        prompt: what the template writes after an assistant turn's content when `messages` follow it,
        less the stop token the model already sampled. Whether appending this reproduces the
        template's rendering of the whole conversation is what `check` verifies."""
        full = self.render(_SYNTHETIC + [{"role": "assistant", "content": _SENTINEL}] + list(messages),
                           add_generation_prompt=True, tools=tools)
        if full.count(_SENTINEL) != 1:
            raise TemplateError("the chat template does not render an assistant turn followed by "
                                f"{[m['role'] for m in messages]} messages with the turn's content intact")
        after = full[full.index(_SENTINEL) + len(_SENTINEL):]
        return after[len(stop_text):] if stop_text is not None and after.startswith(stop_text) else after

    def insertion_ids(self, messages: list[dict], stop_text: str | None, tools: list | None = None) -> list[int]:
        return self.encode(self.insertion_text(messages, stop_text, tools))

    # ------------------------------------------------------------------ the sanity check
    def check(self, ids, messages: list[dict], last_stop_text: str | None, tools: list | None = None
              ) -> TextDiff | None:
        """The difference between the sequence `ids` (prompt + response) and the template's rendering
        of `messages`, or None; under "ignore_strippable" whitespace-only differences count as none."""
        if self.sanity_mode == "disable":
            return None
        ours = self.decode(ids) + self.closing_after(last_stop_text)
        diff = text_diff(ours, self.render(messages, tools=tools))
        if diff is not None and self.sanity_mode == "ignore_strippable" and diff.only_whitespace():
            return None
        return diff

    def probe(self, stop_text: str, tools: list | None = None) -> None:
        """Build a synthetic tool conversation the way the agent loop does and check it; TemplateError
        (naming `tokenization_sanity_check_mode`) if the template fails the configured check. Whatever
        the mode, a template that cannot render a tool turn after an assistant turn fails here."""
        messages = [{"role": "system", "content": "You can call tools."}, {"role": "user", "content": "What is 6 * 7?"}]
        ids = self.prompt_ids(messages, tools)
        first = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
        for content, follow in ((first, [{"role": "tool", "content": "42"}]), ("The answer is 42.", None)):
            ids += self.encode(content + stop_text)
            messages.append({"role": "assistant", "content": content})
            if follow:
                ids += self.insertion_ids(follow, stop_text, tools)
                messages.extend(follow)
        if self.sanity_mode == "disable":
            return
        diff = self.check(ids, messages, stop_text, tools)
        if diff is not None:
            raise TemplateError(
                f"tokenization sanity check ({self.sanity_mode}) failed on a synthetic tool conversation: the "
                f"sequence built turn by turn differs from the chat template's rendering ({diff}). The template "
                "is not append-only; set actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode="
                "ignore_strippable (whitespace differences only) or disable to train on the sampled sequence anyway")
