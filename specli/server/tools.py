"""A chat request's tools and reasoning, as llama-server's --jinja handles them: the tools and
template variables for the template, the grammar that forces a call (tool_choice required or
a named function; the generic format's JSON answer), and the answer read back into content,
reasoning_content and tool_calls, whole or as stream deltas (toolcall.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specli.server.errors import APIError
from specli.server.formats import Choice
from specli.toolcall import (
    GENERIC,
    REASONING_FORMATS,
    ChatOptions,
    Family,
    Parsed,
    family,
    function_of,
    grammar_parts,
    parse,
)
from specli.toolstream import Splitter


@dataclass
class ChatPlan:
    """What a chat request asks of the template and of the answer."""

    opts: ChatOptions
    fam: Family = GENERIC
    tools: tuple[dict, ...] = ()  # those the answer may call (a named choice: that one)
    parse_calls: bool = False  # tool_choice none: shown to the model, never read back
    grammar: tuple[dict, str, list] | None = None  # toolcall.grammar_parts: the grammar host
    reasoning_format: str = "deepseek"
    forced_open: bool = False  # the prompt opened the reasoning (<think> at its end)
    calls_sent: dict[int, int] = field(default_factory=dict)

    @property
    def plain(self) -> bool:
        """Nothing to read back: the text is the content, as before tools."""
        return not self.parse_calls and (self.fam.think is None or
                                         self.reasoning_format == "none") and \
            self.fam.parse_all is None and self.fam.content_wrap is None

    def read(self, text: str) -> Parsed:
        return parse(self.fam, text, self.tools, forced_open=self.forced_open,
                     reasoning_format=self.reasoning_format, parse_calls=self.parse_calls)

    def prompted(self, prompt: str) -> None:
        """The rendered prompt: a template that ends it with the reasoning's opening marker
        has the model start inside its reasoning (DeepSeek R1, QwQ)."""
        think = self.fam.think
        self.forced_open = think is not None and prompt.rstrip().endswith(think[0].rstrip())

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """The assistant's message and finish_reason for a whole answer."""
        if self.plain:
            return {"role": "assistant", "content": text}, finish
        p = self.read(text)
        msg: dict = {"role": "assistant", "content": p.content or (None if p.calls else "")}
        if p.reasoning:
            msg["reasoning_content"] = p.reasoning
        if p.calls:
            msg["tool_calls"] = [c.openai() for c in p.calls]
        return msg, "tool_calls" if p.calls and finish == "stop" else finish

    def choice(self) -> Choice:
        """formats.openai_events' chunk writer: each choice's answer through a Splitter."""
        from specli.server.formats import chat_choice

        if self.plain:
            return chat_choice
        splitters: dict[int, Splitter] = {}

        def choice(text: str | None, finish_reason: str | None, logprobs: dict | None = None,
                   index: int = 0) -> dict:
            s = splitters.get(index)
            if s is None:
                s = splitters[index] = Splitter(
                    self.fam, self.tools, self.forced_open, self.reasoning_format,
                    self.parse_calls)
            d = s.feed(text) if text is not None else s.finish() if finish_reason \
                else Parsed("")
            delta: dict = {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            if d.content:
                delta["content"] = d.content
            if d.calls:
                first = len(s.sent.calls) - len(d.calls)
                delta["tool_calls"] = [{"index": first + k, **c.openai()}
                                       for k, c in enumerate(d.calls)]
            if finish_reason == "stop" and s.sent.calls:
                finish_reason = "tool_calls"
            return {"index": index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        return choice


def plan(body, template: str | None, renders_calls: bool, reasoning: str = "auto",
         reasoning_format: str = "deepseek", kwargs: dict | None = None) -> ChatPlan:
    """A chat request's plan: its tools checked (400s that name the parameter), its template
    variables (the server's --chat-template-kwargs, the request's over them; --reasoning off
    or reasoning_effort none: enable_thinking false), and the family its template is."""
    # (their shapes were checked with the request: schemas.Tool, NamedToolChoice)
    tools = tuple(t.model_dump(exclude_none=True) for t in body.tools or ())
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    named = None
    if not isinstance(choice, str):
        named = choice.function.name
        if not any(function_of(t)["name"] == named for t in tools):
            raise APIError(400, "tool_choice names a function that is not among the tools: "
                           'give {"type": "function", "function": {"name": ...}} with one of '
                           "them", param="tool_choice")
    if choice == "required" and not tools:
        raise APIError(400, "tool_choice is required but there are no tools",
                       param="tool_choice")
    fmt = body.reasoning_format or reasoning_format
    if fmt not in REASONING_FORMATS:
        raise APIError(400, f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}",
                       param="reasoning_format")
    given = dict(kwargs or {})
    if reasoning == "off":
        given["enable_thinking"] = False
    if body.reasoning_effort is not None:
        if body.reasoning_effort == "none":
            given["enable_thinking"] = False
        else:
            given["reasoning_effort"] = body.reasoning_effort
    given.update(body.chat_template_kwargs or {})
    if not isinstance(given.get("enable_thinking", True), bool):
        raise APIError(400, "chat_template_kwargs.enable_thinking must be true or false",
                       param="chat_template_kwargs")
    out = ChatPlan(ChatOptions(tools, given, body.add_generation_prompt is not False),
                   reasoning_format=fmt)
    fam = family(template or "", renders_calls)
    if fam is GENERIC and template and "</think>" in template:
        fam = replace(GENERIC, think=("<think>", "</think>"))
    out.fam = fam
    if not tools or choice == "none":
        return out
    out.parse_calls = True
    out.tools = tuple(t for t in tools if named is None or function_of(t)["name"] == named)
    required = choice == "required" or named is not None
    parallel = body.parallel_tool_calls is not False and named is None
    out.grammar = grammar_parts(fam, out.tools, required, parallel)
    if out.grammar is not None and (body.grammar is not None or body.json_schema is not None
                                    or (body.response_format is not None and
                                        body.response_format.type != "text")):
        raise APIError(400, "cannot use a grammar or a JSON schema with tools: the tools "
                       "bring their own", param="tools")
    return out
