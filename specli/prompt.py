"""Prompts as the target reads them: text and conversations rendered through a model's chat
template (sandboxed, within a time and size budget; chat.py) and tokenized, what cannot fit
the context refused before the full work; and a translating draft's own view of a
conversation, through its own template."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from specli.backend import apply_builtin_template, builtin_templates, knows_template
from specli.errors import ContextOverflowError, UsageError

if TYPE_CHECKING:
    from specli.backend import Backend


class Tokens(list):
    """A prompt's tokens that carry a translating draft's own (draft_prompt), for the
    generation that starts from them: request state, never an engine's."""

    def __init__(self, ids: list[int], draft: list[int] | None):
        super().__init__(ids)
        self.draft = draft


def tokenize(target: Backend, prompt: str) -> list[int]:
    return target.tokenize(fits(target, prompt))


def tokenize_messages(target: Backend, messages: list[dict],
                      continue_final: bool = False) -> list[int]:
    """A conversation rendered with the target's chat template (ChatML when the file has
    none), tokenized with special tokens parsed. What cannot fit the context is refused
    before the full work: more messages than the context has tokens, or more bytes than its
    tokens could spell. continue_final: continue the final assistant message (a prefill)."""
    text = render_messages(target, messages, continue_final)
    bos = target.special_text("bos")
    return target.tokenize(fits(target, text), add_special=not (bos and text.startswith(bos)))


def render_messages(target: Backend, messages: list[dict], continue_final: bool = False) -> str:
    """The conversation as the prompt text tokenize_messages tokenizes."""
    from specli.chat import render_messages as render

    n_ctx = target.n_ctx
    if len(messages) > n_ctx:
        raise ContextOverflowError(
            f"{len(messages)} messages cannot fit a context of {n_ctx} tokens",
            hint="send fewer messages or raise -c/--ctx-size",
            n_prompt_tokens=len(messages), n_ctx=n_ctx)
    # the context's own bound on the output when the contents could reach it; short ones
    # skip measuring the vocabulary (RENDER_BYTES still bounds the template)
    size = sum(len(str(m.get("content") or "")) for m in messages)
    longest = target.max_token_bytes if size > n_ctx else None
    template, builtin = chat_renderer(target.chat_template(), target.params.jinja)
    try:
        return render(template, messages, bos=target.special_text("bos"),
                      eos=target.special_text("eos"),
                      max_bytes=n_ctx * longest if longest else None,
                      continue_final=continue_final, builtin=builtin)
    except ContextOverflowError as e:  # more bytes than n_ctx tokens can spell
        e.n_prompt_tokens, e.n_ctx = n_ctx + 1, n_ctx  # a lower bound
        raise


def draft_prompt(target: Backend, draft: Backend, messages: list[dict],
                 continue_final: bool = False) -> list[int] | None:
    """A draft with another tokenizer reads a conversation through its own chat template
    and special tokens (drafts/translate.py); None where its template refuses what the
    target's takes (roles): it reads the prompt's text instead."""
    from specli.chat import render_messages as render

    template, builtin = chat_renderer(draft.chat_template(), target.params.jinja)
    bos = draft.special_text("bos")
    try:
        text = render(template, messages, bos=bos, eos=draft.special_text("eos"),
                      continue_final=continue_final, builtin=builtin)
    except UsageError:
        return None
    return draft.tokenize(text, add_special=not (bos and text.startswith(bos)))


def fits(target: Backend, text: str) -> str:
    """text, unless it is longer than any n_ctx tokens can spell (no token is longer than
    max_token_bytes): then ContextOverflowError, before tokenizing megabytes."""
    n_ctx = target.n_ctx
    if len(text) <= n_ctx:  # fits whatever the vocabulary: no need to measure it
        return text
    longest = target.max_token_bytes
    if len(text) > n_ctx * longest:  # a character is at least a byte
        raise ContextOverflowError(
            f"the prompt is {len(text)} characters: at most {longest} bytes a token, it "
            f"cannot fit a context of {n_ctx} tokens", hint="shorten the prompt or raise "
            "-c/--ctx-size", n_prompt_tokens=-(-len(text) // longest), n_ctx=n_ctx)
    return text


def chat_renderer(template: str | None, jinja: bool = True
                  ) -> tuple[str | None, Callable[[list[dict], bool], str] | None]:
    """How a chat template renders, as llama-server decides it: (Jinja source, None), or
    (None, llama.cpp's own renderer). With Jinja (the default) a template's source goes
    through the sandbox, "chatml" is ChatML and another llama.cpp built-in name (llama3,
    command-r...) is llama.cpp's renderer; without Jinja every template is llama.cpp's,
    recognised by its name or its text."""
    from specli.chat import FALLBACK_TEMPLATE

    if jinja and template == "chatml":
        return FALLBACK_TEMPLATE, None
    if jinja and template not in builtin_templates():
        return template, None
    # one llama.cpp does not recognise is ChatML, as llama-server falls back (serve warns)
    source = template if template and knows_template(template) else "chatml"
    return None, lambda messages, add: apply_builtin_template(source, messages, add)
