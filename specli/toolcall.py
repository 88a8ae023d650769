"""Tool calls and reasoning in a model's answer, per chat-template family, as llama-server
reads them (common/chat.cpp and common/parsers/ in the vendored llama.cpp).

A family is recognised from its template's text; it says what the model writes when it calls
a tool (the opener that starts a call, then the call's syntax), where its reasoning goes
(`<think>`...`</think>` and the like), and the grammar that forces a call when the request
requires one. A template that never renders tool calls gets the generic format (llama.cpp's
older fallback): the tools listed in the system prompt and an answer in JSON, either
{"tool_calls": [...]} or {"response": "..."}, kept to by a grammar.

`parse` turns a finished answer into content, reasoning and calls; toolstream.Splitter does the
same for a stream, token by token, holding back any text that may still become a marker.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from specli import toolgrammar as tg
from specli.toolgrammar import JSON_CALL, around, lit, loose, obj, repeat, seq, tags
from specli.tooljson import (
    DECODER,
    args_text,
    held,
    json_at,
    json_text,
    partial_string,
    utf8_safe,
)

_ALNUM = string.ascii_letters + string.digits


REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")


class ToolCallError(ValueError):
    """A request's tools, tool_choice or tool messages that cannot be used (a 400)."""


@dataclass(frozen=True)
class ChatOptions:
    """What a chat request adds to its messages for the template: tools (OpenAI's form),
    chat_template_kwargs (enable_thinking...), whether to open the assistant's turn."""

    tools: tuple[dict, ...] = ()
    kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    content: str
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()


def new_id(length: int = 32) -> str:
    """A call id as llama-server makes them (32 letters and digits); Mistral's are 9."""
    return "".join(secrets.choice(_ALNUM) for _ in range(length))


def call_id(fam: Family) -> str:
    """A new id for a call the model wrote without one: OpenAI's shape ("call_" and 24
    letters and digits, as its clients show them), or the family's own (Mistral's 9
    letters and digits, which its template checks)."""
    return "call_" + new_id(24) if fam.id_length is None else new_id(fam.id_length)


# -- the families --------------------------------------------------------------------------

# (name, arguments text, id or None) for each complete call found in a region; arguments None:
# a call whose arguments are no JSON object (the region is then text, as it was written)
CallsFn = Callable[[str, Sequence[dict]], list[tuple[str, str, str | None]]]


@dataclass(frozen=True)
class Family:
    name: str
    openers: tuple[str, ...]  # where a call starts in the answer
    calls: CallsFn
    think: tuple[str, str] | None = ("<think>", "</think>")
    # the grammar of one call of tool i: (GBNF of the call with its rule `call-i`, and whether
    # that rule is the whole JSON call object {name, arguments...} or only the arguments)
    call_gbnf: Callable[[int, str], str] | None = None
    call_object: Callable[[str, dict], dict] | None = None  # JSON families: the call's schema
    # tagged families (a tag per parameter): tool i's call as (its parameters' schemas under
    # their rule names, the call's GBNF over them), from its name and parameters
    call_params: Callable[[str, str, dict], tuple[dict[str, dict], str]] | None = None
    wrap: Callable[[str, bool], str] | None = None  # root from the calls' alternation
    id_length: int | None = None  # a generated id's letters and digits (None: OpenAI's)
    content_wrap: tuple[str, str] | None = None  # Command R7B's <|START_RESPONSE|>...
    parse_all: Callable[[str, Sequence[dict], bool], Parsed] | None = None  # GPT-OSS
    # a parse_all family's call left open at the answer's end (its text), for a cut answer
    open_call: Callable[[str], str | None] | None = None
    lazy: bool = True  # tool_choice auto: the grammar from the first opener on


def _object_calls(keys: tuple[str, str], id_key: str | None = None) -> CallsFn:
    """Calls written as JSON objects (or lists of them) anywhere in the region, with the name
    and arguments under these keys."""
    name_key, args_key = keys

    def calls(region: str, tools: Sequence[dict]) -> list:
        out, at, brackets = [], 0, _OPENING
        while (m := brackets.search(region, at)) is not None:
            start = m.start()
            got = json_at(region, start)
            if got is None:
                if region[start] == "[":  # a marker's bracket ([TOOL_CALLS]), or a list
                    at, brackets = start + 1, _BRACE  # under way whose complete objects
                    continue  # still count (no list after it is read again: linear)
                return out
            value, at = got
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, dict) and isinstance(v.get(name_key), str):
                    args = args_text(v.get(args_key, v.get("arguments",
                                                            v.get("parameters", {}))))
                    ident = v.get(id_key) if id_key else None
                    out.append((v[name_key], args, None if ident is None else
                                ident if isinstance(ident, str) else json_text(ident)))
        return out
    return calls


_OPENING, _BRACE = re.compile(r"[\[{]"), re.compile(r"\{")


def _marked_calls(pattern: str, name: int = 1, ident: int | None = None) -> CallsFn:
    """Calls where the name is outside the JSON arguments: `pattern` matches up to where the
    arguments start (group `name` the name, group `ident` the call's id where it has one)."""
    rx = re.compile(pattern, re.S)

    def calls(region: str, tools: Sequence[dict]) -> list:
        out, at = [], 0
        while (m := rx.search(region, at)) is not None:
            got = json_at(region, m.end())
            if got is None:
                return out
            value, at = got
            out.append((m.group(name).strip(), args_text(value),
                        m.group(ident) if ident else None))
        return out
    return calls


def _spans(region: str, opener: re.Pattern, close: str) -> Iterator[tuple[re.Match, str]]:
    """(the opener's match, the text up to the closer) for each complete span: each closer
    is looked for once, so a region of openers without closers is read in linear time (a
    lazy `(.*?)CLOSE` after each of them was quadratic)."""
    at = 0
    while (m := opener.search(region, at)) is not None:
        end = region.find(close, m.end())
        if end < 0:
            return  # no later opener has a closer either
        yield m, region[m.end():end]
        at = end + len(close)


def _tagged_calls(call_rx: str, close: str, param_rx: str, param_close: str) -> CallsFn:
    """Calls written as tags (Qwen3-Coder's <function=f><parameter=k>v..., GLM's arg_key,
    MiniMax's invoke; call_rx: the opener with the name, close: the call's closing tag;
    param_rx, param_close: a parameter's, with its key): each parameter's text is a string where the
    tool's schema says so, else JSON when it parses as JSON."""
    opener, param = re.compile(call_rx), re.compile(param_rx)

    def calls(region: str, tools: Sequence[dict]) -> list:
        out = []
        for m, body in _spans(region, opener, close):
            name = m.group(1).strip()
            props = _properties(tools, name)
            args = {}
            for p, raw in _spans(body, param, param_close):
                key = p.group(1).strip()
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
                args[key] = _typed(raw, props.get(key, {}))
            out.append((name, json_text(args), None))
        return out
    return calls


def _properties(tools: Sequence[dict], name: str) -> dict:
    for t in tools:
        f = t.get("function", t)
        if f.get("name") == name:
            params = f.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


def _typed(raw: str, schema: dict):
    """A tagged parameter's value: a string where the schema says so, else the JSON (or
    Python literal) it spells, where that has a JSON form; else the text as written."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and kind == ["string"]):
        return raw
    try:
        value = DECODER.decode(raw)
    except (ValueError, RecursionError):
        try:  # Python's spellings (True, None, 'x') as llama.cpp accepts them
            value = ast.literal_eval(raw)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return raw
    return value if json_text(value) is not None else raw


_GEMMA4_CALL = re.compile(r"<\|tool_call>call:([\w.-]{1,256})")


def _gemma4_calls(region: str, tools: Sequence[dict]) -> list:
    """Gemma 4's call:NAME{key:<|"|>text<|"|>,n:1} (bare keys, strings between <|"|>)."""
    out = []
    for m, body in _spans(region, _GEMMA4_CALL, "<tool_call|>"):
        if not (body.startswith("{") and body.endswith("}")):
            continue
        try:
            args = json_text(_gemma4_json(body))
        except (ValueError, RecursionError):
            args = None
        out.append((m.group(1), args, None))
    return out


def _gemma4_json(body: str):
    strings: list[str] = []

    def keep(s: re.Match) -> str:
        strings.append(s.group(1))
        return f"\x00{len(strings) - 1}\x00"

    body = re.sub(r'<\|"\|>(.*?)<\|"\|>', keep, body, flags=re.S)
    body = re.sub(r"([{,]\s*)([A-Za-z_][\w-]*)\s*:", r'\1"\2":', body)
    body = re.sub(r"\x00(\d+)\x00", lambda s: json.dumps(strings[int(s.group(1))]), body)
    return DECODER.decode(body)


_LFM2_CALL = re.compile(re.escape("<|tool_call_start|>"))


def _python_calls(region: str, tools: Sequence[dict]) -> list:
    """LFM2's [f(a="x", b=1), g()] between its markers."""
    out = []
    for _, body in _spans(region, _LFM2_CALL, "<|tool_call_end|>"):
        src = body.strip()
        try:  # JSON's true, false and null as Python's (names, never inside a string)
            tree = _JsonNames().visit(ast.parse(src, mode="eval")).body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            continue
        for c in tree.elts if isinstance(tree, ast.List) else [tree]:
            name = _dotted(c.func) if isinstance(c, ast.Call) else None
            if name is None:
                continue
            args = {k.arg: _literal(src, k.value) for k in c.keywords if k.arg}
            text = json_text(args)
            if text is not None:
                out.append((name, text, None))
    return out


_JSON_NAMES = {"true": True, "false": False, "null": None}


class _JsonNames(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id in _JSON_NAMES:
            return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
        return node


def _dotted(func: ast.expr) -> str | None:
    """A call's name: f, or a dotted Calendar.create_event (LFM2 writes both)."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and (head := _dotted(func.value)) is not None:
        return f"{head}.{func.attr}"
    return None


def _literal(src: str, node: ast.expr):
    """A keyword argument's value, where it is a literal with a JSON form; else its text as
    written (f(x=1j), f(x={1, 2}), f(x=y))."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        value = None
    else:
        if json_text(value) is not None:
            return value
    return ast.get_source_segment(src, node) or ""


def _apertus_calls(region: str, tools: Sequence[dict]) -> list:
    got = json_at(region, region.find("[") if "[" in region else 0)
    if got is None or not isinstance(got[0], list):
        return []
    return [(k, args_text(v), None) for d in got[0] if isinstance(d, dict)
            for k, v in d.items()]


# GPT-OSS's harmony format: messages with a channel (analysis: reasoning; commentary or
# final: the answer), a call where the header names `to=functions.NAME`. Read by a scan,
# linear in the text: a lazy regex over the whole answer was cubic over a stream of an
# answer without markers (18,000 characters took minutes)
HARMONY_END = re.compile(r"<\|(?:end|call|return|start|channel)\|>")


def harmony(text: str, tools: Sequence[dict], final: bool) -> Parsed:
    reasoning, content, calls = [], [], []
    pos = 0
    while (at := text.find("<|message|>", pos)) >= 0:
        header, start = text[pos:at], at + len("<|message|>")
        end = HARMONY_END.search(text, start)
        pos = end.start() if end else len(text)
        body, done = text[start:pos], end is not None or final
        to = re.search(r"to=functions\.([\w.-]+)", header)
        if to is not None:
            got = json_at(body, 0) if done else None
            args = args_text(got[0]) if got and not body[got[1]:].strip() else None
            if args is not None:
                calls.append(ToolCall(to.group(1), args, ""))  # named gives ids
            elif done:  # no call: its text, as written
                content.append(body)
        elif "analysis" in header:
            reasoning.append(body if done else unmarked(body))
        else:
            content.append(body if done else unmarked(body))
    if not calls and not reasoning and not content and "<|message|>" not in text:
        # no channel written (yet: an answer that starts with a header, or blanks so far, is
        # held until its <|message|>)
        lead = text.lstrip()
        content.append(text if final else "" if lead.startswith("<|") or "<|".startswith(lead)
                       else unmarked(text))
    return Parsed("".join(content), "".join(reasoning), tuple(calls))


# Functionary v3.2: the generation prompt ends with `>>>`, then a recipient and a newline:
# `all` for the answer's text (up to the next `>>>`), a function's name for a call, its
# JSON arguments after; further messages each after a `>>>` of their own
_RECIPIENT = re.compile(r"[\w.-]{1,256}")


def _harmony_open(text: str) -> str | None:
    """A GPT-OSS call whose message has not ended: from its recipient on."""
    at = text.rfind("to=functions.")
    return text[at:] if at >= 0 and HARMONY_END.search(text, at) is None else None


def _functionary_open(text: str) -> str | None:
    """Functionary v3.2's last message, unless it is the answer's text (all) or a call
    already whole (its JSON complete: the reading has it)."""
    seg = text[text.rfind(">>>") + 3:] if ">>>" in text else text
    nl = seg.find("\n")
    if seg.startswith("all\n") or "all\n".startswith(seg) or \
            nl >= 0 and json_at(seg, nl + 1) is not None:
        return None
    return seg


def _functionary_v32(text: str, tools: Sequence[dict], final: bool) -> Parsed:
    content, calls, pos, lead = [], [], 0, ""
    while True:
        nl = text.find("\n", pos)
        head = text[pos:] if nl < 0 else text[pos:nl]
        if nl < 0 and not final and (not head or _RECIPIENT.fullmatch(head)):
            break  # `all` or a name still being written
        got = json_at(text, nl + 1) if nl >= 0 and tools and head != "all" and \
            _RECIPIENT.fullmatch(head) else None
        args = args_text(got[0]) if got is not None else None
        if args is None:
            got = None  # arguments that are no JSON object: no call
        tail = text[got[1]:].lstrip() if got is not None else ""
        if head == "all" and nl >= 0:  # the answer's text, up to the next message
            end = text.find(">>>", nl + 1) if tools else -1
            body = text[nl + 1:] if end < 0 else text[nl + 1:end]
            content.append(body if final or end >= 0 else held(body, (">>>",)))
        elif got is not None and (not tail or tail.startswith(">>>") or
                                  not final and ">>>".startswith(tail)):
            # a call: its JSON is read whole first, so a `>>>` inside it is its own
            calls.append(ToolCall(head, args, ""))
            end = len(text) - len(tail) if tail.startswith(">>>") else -1
        elif nl >= 0 and tools and _RECIPIENT.fullmatch(head) and got is None and not final:
            break  # a call under way
        else:  # neither the answer's text nor a call: text as it was written
            end = text.find(">>>", pos) if tools else -1
            seg = lead + (text[pos:] if end < 0 else text[pos:end])
            content.append(seg if final or end >= 0 else held(seg, (">>>",)))
        if end < 0:
            break
        pos, lead = end + 3, ">>>"
    return Parsed("".join(content), "", tuple(calls))


def unmarked(text: str) -> str:
    """text up to a special token still being written (`<|` without its `|>`)."""
    at = text.rfind("<|")
    if at >= 0 and text.find("|>", at + 2) < 0:
        return text[:at]
    return held(text, ("<|",))


DS_CALLS = "<｜tool▁calls▁begin｜>"
DS_CALL, DS_SEP, DS_END, DS_CALLS_END = ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                         "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")

GENERIC = Family(
    "generic", ("{",), _object_calls(("name", "arguments"), "id"), think=None)

FAMILIES: list[tuple[Callable[[str], bool], Family]] = [
    (lambda t: "[TOOL_CALLS]" in t and "[ARGS]" in t and "[CALL_ID]" not in t, Family(
        "ministral", ("[TOOL_CALLS]",), _marked_calls(r"\[TOOL_CALLS\]([^\[]{1,256})\[ARGS\]"),
        think=("[THINK]", "[/THINK]"), call_gbnf=seq("[TOOL_CALLS]NAME[ARGS]", "ARGS"),
        wrap=repeat())),
    (lambda t: "<|channel|>" in t, Family(
        "gpt-oss", (), lambda r, t: [], think=None, parse_all=harmony, open_call=_harmony_open,
        call_gbnf=seq("<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>",
                       "ARGS"), wrap=repeat())),
    (lambda t: "<|tool_calls_section_begin|>" in t and "<|tool_call_begin|>" in t, Family(
        # the call's id is functions.NAME:INDEX
        "kimi-k2", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"), _marked_calls(
            r"<\|tool_call_begin\|>\s*((?:functions\.)?([\w.-]+?)(?::\d+)?)\s*"
            r"<\|tool_call_argument_begin\|>", name=2, ident=1),
        call_gbnf=seq("<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>",
                       "ARGS", "<|tool_call_end|>"),
        wrap=lambda c, p: f'"<|tool_calls_section_begin|>" ({c})' + (f" ({c})*" if p else "")
        + ' "<|tool_calls_section_end|>"')),
    (lambda t: "<|tool_list_start|>" in t or "List of tools: [" in t, Family(
        "lfm2", ("<|tool_call_start|>",), _python_calls,
        call_params=tags("NAME(", "KEY=", "", ")", sep=", ", text=None),
        wrap=around("<|tool_call_start|>[", "]<|tool_call_end|>"))),
    (lambda t: "<|tool_call>call:" in t, Family(
        "gemma4", ("<|tool_call>",), _gemma4_calls, think=("<|channel>thought", "<channel|>"),
        call_params=tags("<|tool_call>call:NAME{", "KEY:", "", "}<tool_call|>", sep=",",
                          text=f"{lit(tg.GEMMA4_QUOTE)} TEXT {lit(tg.GEMMA4_QUOTE)}",
                          body=tg.GEMMA4_TEXT, values=tg.GEMMA4_VALUE),
        wrap=repeat())),
    (lambda t: "<tool_call>" in t and "<function=" in t and "<parameter=" in t, Family(
        "qwen3-coder", ("<tool_call>", "<function="),
        _tagged_calls(r"<function=([^<>\n]{1,256})>", "</function>",
                      r"<parameter=([^<>\n]{1,256})>", "</parameter>"),
        call_params=tags("<tool_call>\n<function=NAME>\n", "<parameter=KEY>\n",
                          "\n</parameter>\n", "</function>\n</tool_call>"),
        wrap=repeat("\n"))),
    (lambda t: "<arg_key>" in t and "<tool_call>" in t, Family(
        "glm", ("<tool_call>",), _tagged_calls(
            r"<tool_call>\s{0,64}([^<\n]{1,256})", "</tool_call>",
            r"<arg_key>([^<]{0,256})</arg_key>\s{0,64}<arg_value>", "</arg_value>"),
        call_params=tags("<tool_call>NAME\n", "<arg_key>KEY</arg_key>\n<arg_value>",
                          "</arg_value>\n", "</tool_call>", literal=loose),  # 4.6 and 4.7
        wrap=repeat("\n", optional=True))),
    (lambda t: "<minimax:tool_call>" in t, Family(
        "minimax-m2", ("<minimax:tool_call>",), _tagged_calls(
            r'<invoke name="([^"\n]{1,256})">', "</invoke>",
            r'<parameter name="([^"\n]{1,256})">', "</parameter>"),
        call_params=tags('<invoke name="NAME">\n', '<parameter name="KEY">',
                          "</parameter>\n", "</invoke>\n"),
        wrap=around("<minimax:tool_call>\n", "</minimax:tool_call>", ""))),
    (lambda t: "tool▁calls▁begin" in t and "```json" in t, Family(
        "deepseek-r1", (DS_CALLS, DS_CALL),
        _marked_calls(rf"{DS_CALL}\s*(?:function)?{DS_SEP}([^<\n]{{1,256}})\n```json"),
        call_gbnf=seq(f"{DS_CALL}function{DS_SEP}NAME\n```json\n", "ARGS",
                       f"\n```{DS_END}"), wrap=around(DS_CALLS, DS_CALLS_END, ""))),
    (lambda t: "tool▁calls▁begin" in t, Family(
        "deepseek-v3.1", (DS_CALLS, DS_CALL),
        _marked_calls(rf"{DS_CALL}\s*([^<]{{0,256}}?){DS_SEP}"),
        call_gbnf=seq(f"{DS_CALL}NAME{DS_SEP}", "ARGS", DS_END),
        wrap=around(DS_CALLS, DS_CALLS_END, ""))),
    (lambda t: "<|START_ACTION|>" in t and "<|START_THINKING|>" in t, Family(
        "command-r7b", ("<|START_ACTION|>",),
        _object_calls(("tool_name", "parameters"), "tool_call_id"),
        think=("<|START_THINKING|>", "<|END_THINKING|>"),
        call_object=obj("tool_name", "parameters"), call_gbnf=JSON_CALL,
        wrap=around("<|START_ACTION|>[", "]<|END_ACTION|>"),
        content_wrap=("<|START_RESPONSE|>", "<|END_RESPONSE|>"))),
    (lambda t: "[TOOL_CALLS]" in t and "[CALL_ID]" in t, Family(
        "mistral-small", ("[TOOL_CALLS]",),
        _marked_calls(r"\[TOOL_CALLS\]([^\[]{1,256})\[CALL_ID\]\s{0,64}(\w{1,64})\s{0,64}\[ARGS\]",
                      ident=2),
        think=None, id_length=9,
        call_gbnf=seq("[TOOL_CALLS]NAME[CALL_ID]", "ID9", "[ARGS]", "ARGS"),
        wrap=repeat())),
    (lambda t: "[TOOL_CALLS]" in t, Family(
        "mistral-nemo", ("[TOOL_CALLS]",), _object_calls(("name", "arguments"), "id"),
        think=None, id_length=9, call_object=obj(
            "name", "arguments", {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}),
        call_gbnf=JSON_CALL, wrap=around("[TOOL_CALLS][", "]"))),
    (lambda t: " functools[" in t, Family(
        "firefunction-v2", (" functools[", "functools["), _object_calls(("name", "arguments")),
        think=None, call_object=obj("name", "arguments"), call_gbnf=JSON_CALL,
        wrap=around(" functools[", "]"))),
    (lambda t: ">>>all" in t and ">>>${recipient}" in t, Family(
        "functionary-v3.2", (), lambda r, t: [], think=None, parse_all=_functionary_v32,
        open_call=_functionary_open,
        call_gbnf=seq("NAME\n", "ARGS"), wrap=repeat(">>>"))),  # no opener: auto is free
    (lambda t: "<function=" in t, Family(
        "functionary-v3.1", ("<function=",), _marked_calls(r"<function=([^<>]{1,256})>"),
        think=None, call_gbnf=seq("<function=NAME>", "ARGS", "</function>"),
        wrap=repeat())),
    (lambda t: "<|tools_prefix|>" in t, Family(
        "apertus", ("<|tools_prefix|>",), _apertus_calls, think=None)),
    (lambda t: "<tool_call>" in t, Family(
        "hermes", ("<tool_call>",), _object_calls(("name", "arguments")),
        call_object=obj("name", "arguments"),
        call_gbnf=seq("<tool_call>\n", "ARGS", "\n</tool_call>"), wrap=repeat("\n"))),
    (lambda t: "<|start_header_id|>" in t and "parameters" in t, Family(
        # (the call grammar's JSON may put a blank after the brace: llama.cpp's " "?)
        "llama3", ('{"name"', '{"type"', '{ "name"', '{ "type"'),
        _object_calls(("name", "parameters")),
        think=None, call_object=obj("name", "parameters"), call_gbnf=JSON_CALL,
        # one call a turn; no marker to wait for: auto reads the call from free text
        wrap=lambda c, p: f"({c})", lazy=False)),
]


def family(template: str, renders_calls: bool) -> Family:
    """The family of a chat template, as llama.cpp tells them apart by their text; generic
    for a template that never renders a tool call."""
    if not renders_calls:
        return GENERIC
    for match, fam in FAMILIES:
        if match(template):
            return fam
    return GENERIC


# -- reading an answer ---------------------------------------------------------------------

def split_reasoning(text: str, think: tuple[str, str] | None, forced_open: bool,
                    final: bool) -> tuple[str, str, bool]:
    """(reasoning, the rest, whether the reasoning is closed). Reasoning is the text between
    the family's markers at the start of the answer, or from the start when the prompt
    opened it (a template that ends its generation prompt with `<think>`); an answer that
    ends inside it is all reasoning."""
    if think is None:
        return "", text, True
    start, end = think
    body = text
    if not forced_open:
        lead = text.lstrip()
        if not lead.startswith(start):
            if not final and start.startswith(lead) and lead:
                return "", "", False  # may still become the opening marker
            return "", text, True
        body = lead[len(start):]
    at = body.find(end)
    if at < 0:
        return (body if final else held(body, (end,))), "", False
    return body[:at], body[at + len(end):], True


def _generic_json(lead: str) -> bool:
    """Whether an unfinished JSON answer is the generic format's: its calls or its response,
    or a key that may still become one."""
    m = re.match(r'\{\s*("[^"]*"?)?', lead)
    if m is None or m[1] is None:
        return m is not None and lead[m.end():].strip() == ""
    return m[1].startswith('"tool_call') or any(w.startswith(m[1])
                                                 for w in ('"tool_calls"', '"response"'))


_CALL_OBJECT = re.compile(r'\{\s*"name"\s*:')


def _cut_calls(lead: str, tools: Sequence[dict]) -> tuple[ToolCall, ...]:
    """The generic answer's calls when the limit cut it: each whole call object, then the
    last one as far as it was written (cut_call)."""
    starts = [m.start() for m in _CALL_OBJECT.finditer(lead)]
    out = []
    for at in starts[:-1]:
        got = json_at(lead, at)
        value = got[0] if got is not None else None
        args = args_text(value.get("arguments")) if isinstance(value, dict) else None
        if args is None or not isinstance(value.get("name"), str):
            return ()  # a whole call that is no call: nothing read as a call
        out.append(ToolCall(value["name"], args, ""))
    last = cut_call(lead[starts[-1]:], tools) if starts else None
    return (*out, *((last,) if last else ()))


def read_generic(text: str, final: bool, cut: bool = False, tools: Sequence[dict] = ()
                 ) -> Parsed:
    lead = text.lstrip()
    got = json_at(lead, 0) if lead.startswith("{") else None
    if got is None:
        m = re.match(r'\{\s*"response"\s*:\s*"', lead) if lead.startswith("{") else None
        if lead.startswith("{") and (not final or cut and m):  # its response so far
            return Parsed(partial_string(lead[m.end():]) if m else "")
        if cut and _generic_json(lead):  # the limit cut the JSON answer short: no text
            return Parsed("", "", _cut_calls(lead, tools))
        return Parsed(text if final or not lead.startswith("{") else "")
    value = got[0]
    if isinstance(value, dict) and ("tool_calls" in value or "tool_call" in value):
        raw = json_text(value.get("tool_calls", [value.get("tool_call")]))
        calls = _object_calls(("name", "arguments"), "id")(raw, ()) if raw else []
        if any(a is None for _, a, _ in calls):
            return Parsed(text)  # a call that is no call: the answer is text
        return Parsed("", "", tuple(ToolCall(n, a, i or "") for n, a, i in calls))
    if isinstance(value, dict) and "response" in value:
        r = value["response"]
        return Parsed(utf8_safe(r) if isinstance(r, str) else json_text(r) or text)
    return Parsed(text)


def cut_call(region: str, tools: Sequence[dict]) -> ToolCall | None:
    """The call a token limit cut short, as llama-server and OpenAI give it: its name, once
    written whole (the first of the tools' names in the call region), and its arguments as
    far as they were written (from their opening brace; "{" before it): text that is no
    JSON yet, with finish_reason length to say so. None: no name yet."""
    best = None
    for t in tools:
        name = function_of(t)["name"]
        m = re.search(rf"(?<![\w-]){re.escape(name)}(?=[^\w.-])", region)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), m.end(), name)
    if best is None:
        return None
    brace = region.find("{", best[1])
    return ToolCall(best[2], region[brace:] if brace >= 0 else "{", "")


def parse(fam: Family, text: str, tools: Sequence[dict] = (), *, forced_open: bool = False,
          reasoning_format: str = "deepseek", parse_calls: bool = True,
          final: bool = True, ids: list[str] | None = None, cut: bool = False) -> Parsed:
    """An answer as content, reasoning and calls. Not final: what is certain so far (text
    that may still become a marker, and a call not yet complete, are left out). cut: the
    answer was cut short by the token limit: a call region left open is no text; its call
    is given as far as it was written (cut_call), when its name was."""
    if fam.parse_all is not None:  # (cut: what was certain, never a half call as text)
        p = fam.parse_all(text, tools, final and not cut)
        open_call = fam.open_call(text) if cut and fam.open_call else None
        if open_call and (c := cut_call(open_call, tools)):
            p = Parsed(p.content, p.reasoning, (*p.calls, c))
        if reasoning_format == "none" and p.reasoning:
            p = Parsed(text if final else held(text, ("<|",)), "", p.calls)
        return named(p, ids, fam) if parse_calls else Parsed(p.content, p.reasoning)
    if reasoning_format == "none":
        reasoning, rest = "", (f"{fam.think[0]}{text}" if forced_open and fam.think
                               else text)
    else:
        reasoning, rest, closed = split_reasoning(text, fam.think, forced_open, final)
        if not closed:
            return Parsed("", reasoning)
    if fam.name == "generic":
        p = read_generic(rest, final, cut, tools) if parse_calls else Parsed(rest)
        return named(Parsed(p.content, reasoning, p.calls), ids, fam)
    at = min((i for i in (rest.find(o) for o in fam.openers) if i >= 0), default=-1) \
        if parse_calls and fam.openers else -1
    before, region = (rest, "") if at < 0 else (rest[:at], rest[at:])
    calls = fam.calls(region, tools) if region else []
    no_call = any(args is None for _, args, _ in calls)
    if no_call:
        calls = []  # a call that is no call: the region is text, as it was written
    if final and region and not calls:
        if cut and not no_call:  # a call the limit cut short: never text
            c = cut_call(region, tools)
            calls = [(c.name, c.arguments, None)] if c else []
        else:  # an opener that began no call: it was text
            before, region = rest, ""
    if not final and not region:
        before = held(before, (*fam.openers, *(fam.content_wrap or ())) if parse_calls
                       else (fam.content_wrap or ()))
    elif cut and not region and parse_calls:  # an opener the limit cut short is no text
        before = held(before, fam.openers)
    if fam.content_wrap is not None:
        before = before.replace(fam.content_wrap[0], "").replace(fam.content_wrap[1], "")
    out = Parsed(before, reasoning, tuple(ToolCall(n, a, i or "") for n, a, i in calls))
    return named(out, ids, fam)


def named(p: Parsed, ids: list[str] | None, fam: Family) -> Parsed:
    """Calls without an id of their own get one, the same one each time the stream is read
    again (ids: the ids given so far, by position)."""
    ids = [] if ids is None else ids
    calls = []
    for k, c in enumerate(p.calls):
        if k >= len(ids):
            ids.append(c.id or call_id(fam))
        calls.append(ToolCall(c.name, c.arguments, ids[k]))
    return Parsed(p.content, p.reasoning, tuple(calls))


# -- the grammar of a required call --------------------------------------------------------

def function_of(tool: dict) -> dict:
    """A tool's function (OpenAI's {"type": "function", "function": {...}})."""
    f = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
        raise ToolCallError("each tool is {\"type\": \"function\", \"function\": {\"name\": "
                            "..., \"parameters\": {...}}}")
    return f


def grammar_parts(fam: Family, tools: Sequence[dict], required: bool, parallel: bool,
                  ) -> tuple[dict[str, dict], str, list[str]] | None:
    """The grammar that makes the answer a call of one of `tools` (required); for
    tool_choice auto the same, lazy: from the family's opener on, free text before it (as
    llama.cpp's lazy grammars); for the generic format a call or a JSON response. The
    schemas to convert, each under its rule name, the root rule over them, and the texts
    that trigger a lazy grammar. None where the family has no grammar here (its call is then
    read from free text)."""
    if fam.name == "generic":
        items = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": f["name"]}, "arguments": _params(f)},
            "required": ["name", "arguments"]} for f in map(function_of, tools)]}
        calls = {"type": "object", "properties": {"tool_calls": {
            "type": "array", "items": items, "minItems": 1,
            **({} if parallel else {"maxItems": 1})}}, "required": ["tool_calls"]}
        response = {"type": "object", "properties": {"response": {"type": "string"}},
                    "required": ["response"]}
        return {"call-0": calls if required else {"anyOf": [calls, response]}}, "call-0", []
    if fam.call_gbnf is None and fam.call_params is None \
            or not (required or fam.lazy and fam.openers):
        return None
    schemas, alts = {}, []
    for i, f in enumerate(map(function_of, tools)):
        params = _params(f)
        if fam.call_params is not None:  # a tagged family: a rule per parameter
            own, gbnf = fam.call_params(str(i), f["name"], params)
            schemas.update(own)
            alts.append(gbnf)
            continue
        schemas[f"call-{i}"] = fam.call_object(f["name"], params) if fam.call_object \
            else params
        alts.append(fam.call_gbnf(str(i), f["name"]))
    one = " | ".join(f"({a})" for a in alts)
    return schemas, fam.wrap(one, parallel), [] if required else [fam.openers[0]]


def _params(f: dict) -> dict:
    p = f.get("parameters")
    return p if isinstance(p, dict) and p else {"type": "object"}
