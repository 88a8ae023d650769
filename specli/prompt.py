"""Prompts as the target reads them: text and conversations rendered through a model's chat
template (sandboxed, within a time and size budget; chat.py) and tokenized, what cannot fit
the context refused before the full work; and a translating draft's own view of a
conversation, through its own template."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

from specli.backend import apply_builtin_template, builtin_templates, knows_template
from specli.errors import ContextOverflowError, UsageError
from specli.toolcall import ChatOptions

if TYPE_CHECKING:
    from specli.backend import Vocabulary


def tokenize(target: Vocabulary, prompt: str) -> list[int]:
    return target.tokenize(fits(target, prompt))


def tokenize_messages(target: Vocabulary, messages: list[dict], continue_final: bool = False,
                      opts: ChatOptions | None = None) -> list[int]:
    """A conversation rendered with the target's chat template (ChatML when the file has
    none), tokenized with special tokens parsed. What cannot fit the context is refused
    before the full work: more messages than the context has tokens, or more bytes than its
    tokens could spell. continue_final: continue the final assistant message (a prefill)."""
    return chat_prompt(target, messages, continue_final, opts)[1]


def chat_prompt(target: Vocabulary, messages: list[dict], continue_final: bool = False,
                opts: ChatOptions | None = None) -> tuple[str, list[int]]:
    """The conversation's prompt text and its tokens (tokenize_messages)."""
    text = render_messages(target, messages, continue_final, opts)
    bos = target.special_text("bos")
    return text, target.tokenize(fits(target, text),
                                  add_special=not (bos and text.startswith(bos)))


def render_messages(target: Vocabulary, messages: list[dict], continue_final: bool = False,
                    opts: ChatOptions | None = None) -> str:
    """The conversation as the prompt text tokenize_messages tokenizes: with opts, the
    request's tools and template variables as llama.cpp gives them (prepare)."""
    from specli.template_host import render_messages as render

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
    opts = opts or ChatOptions()
    context = None
    if builtin is None:
        messages, context = prepare(template, messages, opts)
    elif opts.tools:
        raise UsageError("tools need the chat template rendered as Jinja",
                         hint="start the server without --no-jinja")
    try:
        return render(template, messages, bos=target.special_text("bos"),
                      eos=target.special_text("eos"),
                      max_bytes=n_ctx * longest if longest else None,
                      continue_final=continue_final, builtin=builtin, context=context,
                      add_generation_prompt=opts.add_generation_prompt)
    except ContextOverflowError as e:  # more bytes than n_ctx tokens can spell
        e.n_prompt_tokens, e.n_ctx = n_ctx + 1, n_ctx  # a lower bound
        raise


def draft_prompt(target: Vocabulary, draft: Vocabulary, messages: list[dict],
                 continue_final: bool = False) -> list[int] | None:
    """A draft with another tokenizer reads a conversation through its own chat template
    and special tokens (drafts/translate.py); None where its template refuses what the
    target's takes (roles): it reads the prompt's text instead."""
    from specli.template_host import render_messages as render

    template, builtin = chat_renderer(draft.chat_template(), target.params.jinja)
    bos = draft.special_text("bos")
    try:
        text = render(template, messages, bos=bos, eos=draft.special_text("eos"),
                      continue_final=continue_final, builtin=builtin)
    except UsageError:
        return None
    return draft.tokenize(text, add_special=not (bos and text.startswith(bos)))


def fits(target: Vocabulary, text: str) -> str:
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


def jinja_source(target: Vocabulary) -> tuple[bool, str | None]:
    """(whether the target's chat template renders as Jinja, its source: None for
    ChatML's fallback)."""
    template, builtin = chat_renderer(target.chat_template(), target.params.jinja)
    return builtin is None, template


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


# -- messages and tools for a template, as llama.cpp prepares them (common/chat.cpp) ---------

PROBE_SECONDS = 0.25  # a real template renders a probe in milliseconds: a hostile one is no
# longer


@lru_cache(maxsize=16)
def template_caps(template: str | None) -> tuple[bool, bool, bool]:
    """What a template does, found by rendering it (as llama.cpp's caps probe), in the
    templates' own process (chat.caps_here): (renders a system message, renders assistant
    tool calls, wants a call's arguments as an object rather than JSON text)."""
    from specli import template_host

    try:
        return template_host.caps(template, PROBE_SECONDS)
    except template_host.Busy:
        raise  # not the template's answer: asked again next time
    except UsageError:  # its probes ran past their time: a template probed to have no
        return False, False, False  # system role and to render no calls, once for all


GENERIC_SYSTEM = ("You can call any of the following tools to satisfy the user's requests: "
                  "{tools}\n\nRespond in JSON format, either with `tool_calls` (a request to "
                  "call tools) or with `response` reply to the user's request")


def prepare(template: str | None, messages: list[dict], opts: ChatOptions
            ) -> tuple[list[dict], dict]:
    """The messages and template variables for a chat request, as llama.cpp hands them to
    a template: a call's arguments as objects where the template writes them out as JSON,
    a system message merged into the next where the template has no system role, and for a
    template that renders no tool calls (the generic format) the tools described in the
    system prompt, earlier calls and results written as the JSON the model answers in."""
    from specli.chat import template_context

    tools = list(opts.tools)
    context = template_context(opts.kwargs)
    context["functions"] = ""  # firefunction's: llama.cpp gives it no tools (but defined)
    if tools:
        context["tools"] = tools
    out = _reasoning_fields(template or "", [dict(m) for m in messages])
    calls = tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in out)
    if not calls and not (out and out[0].get("role") == "system"):
        return out, context  # nothing to ask of the template (a plain chat probes nothing)
    has_system, renders, objects = template_caps(template)
    for m in out:
        if m.get("tool_calls") is not None and m.get("content") is None:
            m["content"] = ""
    if not renders and (tools or any(m.get("tool_calls") or m.get("role") == "tool"
                                     for m in out)):
        out = _generic(out, tools)
    elif objects:
        for m in out:
            if m.get("tool_calls"):
                m["tool_calls"] = [_object_arguments(c) for c in m["tool_calls"]]
    if "'<|tool_call>call:'" in (template or "") and \
            "{#- OpenAI Chat Completions:" not in (template or ""):
        out = _gemma4_turns(out)  # Gemma 4's older templates, as llama.cpp works around them
    if not has_system and out and out[0].get("role") == "system":
        first, *rest = out
        if rest:
            rest[0] = {**rest[0], "content": f"{first.get('content') or ''}\n"
                       f"{rest[0].get('content') or ''}"}
        out = rest
    return out, context


def _reasoning_fields(template: str, messages: list[dict]) -> list[dict]:
    """Earlier turns' reasoning where the template reads it, as llama.cpp hands it over:
    as `thinking` to the templates that read a message's thinking (LFM2.5, Cohere2 MoE,
    GPT-OSS), as a content block of type thinking to Ministral 3's (its system and
    assistant messages all become blocks then)."""
    if not any(isinstance(m.get("reasoning_content"), str) for m in messages):
        return messages
    if _THINKING_FIELD.search(template):
        for m in messages:
            if isinstance(m.get("reasoning_content"), str):
                m["thinking"] = m["reasoning_content"]
    if "[SYSTEM_PROMPT]" in template and "[ARGS]" in template and "[CALL_ID]" not in \
            template and "'thinking'" in template:
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "assistant"):
                continue
            blocks = []
            if isinstance(m.get("reasoning_content"), str):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"]})
            content = m.get("content")
            blocks += content if isinstance(content, list) else \
                [{"type": "text", "text": content}] if isinstance(content, str) else []
            messages[i] = {k: v for k, v in m.items() if k != "reasoning_content"} | {
                "content": blocks}
    return messages


def _gemma4_turns(messages: list[dict]) -> list[dict]:
    """A call, its results and the answer after them as one model turn with
    `tool_responses` (the results, JSON where they parse as JSON, each named after its
    call), which Gemma 4's older templates read instead of tool messages."""
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(m)
            i += 1
            continue
        turn = {"role": "assistant", "tool_calls": list(m["tool_calls"])}
        if isinstance(m.get("reasoning_content"), str):
            turn["reasoning_content"] = m["reasoning_content"]
        responses, i = [], i + 1
        while i < len(messages) and messages[i].get("role") == "tool":
            r = messages[i]
            content = r.get("content")
            try:
                content = json.loads(content) if isinstance(content, str) else content
            except (ValueError, RecursionError):
                pass  # text, as it was sent
            calls = turn["tool_calls"]
            name = (calls[len(responses)].get("function") or {}).get("name", "") \
                if len(responses) < len(calls) else ""
            responses.append({"name": name or r.get("tool_call_id", ""), "response": content})
            i += 1
        if responses:
            turn["tool_responses"] = responses
        if i < len(messages) and messages[i].get("role") == "assistant" and \
                not messages[i].get("tool_calls") and messages[i].get("content"):
            turn["content"] = messages[i]["content"]
            i += 1
        out.append(turn)
    return out


_THINKING_FIELD = re.compile(r"""message\.thinking\b|message\[['"]thinking['"]\]""")


def _object_arguments(call: dict) -> dict:
    f = call.get("function") or {}
    args = f.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise UsageError(f"the arguments of tool call {f.get('name')!r} are not JSON: "
                             f"{args[:80]!r}") from None
        except RecursionError:
            raise UsageError(f"the arguments of tool call {f.get('name')!r} nest too deeply "
                             "to be read") from None
    return {**call, "function": {**f, "arguments": args}}


def _generic(messages: list[dict], tools: list[dict]) -> list[dict]:
    out: list[dict] = []
    names = {c.get("id"): (c.get("function") or {}).get("name") for m in messages
             for c in m.get("tool_calls") or ()}
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"],
                      "arguments": _object_arguments(c)["function"]["arguments"],
                      **({"id": c["id"]} if c.get("id") else {})} for c in m["tool_calls"]]
            out.append({"role": "assistant",
                        "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
        elif role == "tool":
            reply = {"tool_response": {"tool": m.get("name") or names.get(m.get("tool_call_id"))
                                       or "",
                                       "content": m.get("content") or ""}}
            text = json.dumps(reply, ensure_ascii=False)
            if out and out[-1].get("role") == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_tool": True})
        elif role == "assistant" and out and out[-1].get("role") == "assistant":
            out.append(dict(m))
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool", None)
    if tools:
        note = GENERIC_SYSTEM.format(tools=json.dumps(tools, indent=2, ensure_ascii=False))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out
