"""A chat request's tools and reasoning, as llama-server's --jinja handles them: the tools and
template variables for the template, the grammar that forces a call (tool_choice required or
a named function; the generic format's JSON answer), and the answer read back into content,
reasoning_content and tool_calls, whole or as stream deltas (toolcall.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from specli.server.errors import APIError
from specli.server.slots import Done, Piece, Progress
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

    def read(self, text: str, cut: bool = False) -> Parsed:
        """A whole answer read (cut: by the token limit, toolcall.parse)."""
        return parse(self.fam, text, self.tools, forced_open=self.forced_open,
                     reasoning_format=self.reasoning_format, parse_calls=self.parse_calls,
                     cut=cut)

    def prompted(self, prompt: str) -> None:
        """The rendered prompt: a template that ends it with the reasoning's opening marker
        has the model start inside its reasoning (DeepSeek R1, QwQ)."""
        think = self.fam.think
        self.forced_open = think is not None and prompt.rstrip().endswith(think[0].rstrip())

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """The assistant's message and finish_reason for a whole answer."""
        if self.plain:
            return {"role": "assistant", "content": text}, finish
        p = self.read(text, finish == "length")
        msg: dict = {"role": "assistant", "content": p.content or (None if p.calls else "")}
        if p.reasoning:
            msg["reasoning_content"] = p.reasoning
        if p.calls:
            msg["tool_calls"] = [c.openai() for c in p.calls]
        return msg, "tool_calls" if p.calls and finish == "stop" else finish

    def reader(self) -> Splitter | None:
        """A reader for one choice's streamed answer (None: the text is the content)."""
        if self.plain:
            return None
        return Splitter(self.fam, self.tools, self.forced_open, self.reasoning_format,
                        self.parse_calls)

    def delta(self, r: Read) -> dict:
        """OpenAI's chat delta of a step of the reading."""
        if r.plain:
            return {"content": r.piece.text} if r.piece is not None and r.piece.text else {}
        d, delta = r.delta, {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        if d.calls:
            delta["tool_calls"] = [{"index": r.first_call + k, **c.openai()}
                                   for k, c in enumerate(d.calls)]
        return delta


@dataclass
class Read:
    """One step of a choice's answer as read: what its piece adds (the end's reading, with
    its Done, once it ends). Every API's stream encoder takes these (server/formats.py,
    server/compat.py)."""

    index: int  # the choice
    delta: Parsed  # the reasoning, content and calls this step adds
    piece: Piece | None = None  # the piece read: its tokens, probabilities and timings
    done: Done | None = None  # the choice's end
    first_call: int = 0  # the index of delta.calls[0] among the choice's calls
    called: bool = False  # the choice's answer has calls so far
    plain: bool = False  # not read: the text is the content


async def reading(events: AsyncIterator[Piece | Progress | Done], plan: ChatPlan | None
                  ) -> AsyncIterator[Read | Progress]:
    """A generation's events as each choice's answer read (plan None: a completion's text,
    content as it comes); prompt progress passes through."""
    readers: dict[int, Splitter | None] = {}
    async for ev in events:
        if isinstance(ev, Progress):
            yield ev
            continue
        if ev.index not in readers:
            readers[ev.index] = plan.reader() if plan is not None else None
        s = readers[ev.index]
        piece, done = (ev, None) if isinstance(ev, Piece) else (None, ev)
        if s is None:
            yield Read(ev.index, Parsed(piece.text if piece else ""), piece, done, plain=True)
            continue
        before = len(s.sent.calls)
        d = s.feed(piece.text) if piece is not None else s.finish(done.finish_reason == "length")
        yield Read(ev.index, d, piece, done, before, bool(s.sent.calls))


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
