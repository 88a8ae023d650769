"""The GBNF a template family's required tool call is written in, built from literal pieces
around the tool's name and arguments (toolcall.FAMILIES declares each family's with these;
toolcall.grammar_parts puts a request's tools through them): a JSON call's pieces (seq,
obj), a call written a parameter at a time (tags), and how calls follow each other (repeat,
around). GBNF text only: the schemas are converted where the grammar is built
(backend.schemas_grammar)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable


def lit(s: str) -> str:
    """A GBNF string literal."""
    out = json.dumps(s, ensure_ascii=False)
    return out.replace("\\/", "/")


def loose(s: str) -> str:
    """A literal whose line breaks may be left out (GLM 4.6 writes them, 4.7 does not)."""
    parts = s.split("\n")
    return " ".join(x for k, p in enumerate(parts)
                    for x in ([lit(p)] if p else []) + (['"\\n"?'] if k < len(parts) - 1 else []))


def until(*tags: str) -> str:
    """Any text that holds none of the closing `tags` (a parameter's </parameter>, and its
    call's </function>, which the reader would end the call at): another tag (a value's
    own </title>) is text. Each proper prefix of a tag may be followed by anything but the
    tags' next characters and "<" (which begins a prefix of its own)."""
    nexts: dict[str, set[str]] = {}
    for tag in tags:
        for k in range(1, len(tag)):
            nexts.setdefault(tag[:k], set()).add(tag[k])

    def esc(c: str) -> str:
        return "\\" + c if c in "]\\-" else c

    alts = ["[^<]"] + [f"{lit(p)} [^{''.join(esc(c) for c in sorted(cs | {'<'}))}]"
                       for p, cs in sorted(nexts.items())]
    return "(" + " | ".join(alts) + ")*"


def seq(*parts: str) -> Callable[[int, str], str]:
    """One call's GBNF: literal pieces around NAME (the tool's name) and ARGS (its rule)."""
    def gbnf(i: str, name: str) -> str:
        out = []
        for p in parts:
            out.append(f"call-{i}" if p == "ARGS" else "[a-zA-Z0-9]{9}" if p == "ID9"
                       else lit(p.replace("NAME", name)))
        return " ".join(out)
    return gbnf


def obj(name_key: str, args_key: str, id_schema: dict | None = None):
    def schema(name: str, params: dict) -> dict:
        props = {name_key: {"const": name}, args_key: params}
        if id_schema is not None:
            props["id"] = id_schema
        return {"type": "object", "properties": props, "required": list(props)}
    return schema


def repeat(sep: str = "", optional: bool = False) -> Callable[[str, bool], str]:
    def wrap(call: str, parallel: bool) -> str:
        # (the alternation in parentheses: a separator before any call, not the first tool's)
        s = f"{lit(sep)}{'?' if optional else ''} " if sep else ""
        more = f" ({s}({call}))*" if parallel else ""
        return f"({call}){more}"
    return wrap


def around(before: str, after: str, sep: str = ", ") -> Callable[[str, bool], str]:
    def wrap(call: str, parallel: bool) -> str:
        more = f" ({lit(sep) + ' ' if sep else ''}({call}))*" if parallel else ""
        return f"{lit(before)} ({call}){more} {lit(after)}"
    return wrap


JSON_CALL = seq("ARGS")
# a tagged parameter's string value: any text but "</", which begins a closing tag
TAG_TEXT = '([^<] | "<" [^/])*'


def tags(call_open: str, param_open: str, param_close: str, call_close: str, *,
          sep: str = "", text: str | None = "TEXT", body: str | None = None,
          literal: Callable[[str], str] = lit, values: tuple[str, str] | None = None
          ) -> Callable[[str, str, dict], tuple[dict[str, dict | str], str]]:
    """A call written a parameter at a time (Qwen3-Coder's <function=NAME><parameter=KEY>,
    GLM's <arg_key>, MiniMax's <invoke>, Gemma 4's call:NAME{KEY:...}, LFM2's NAME(KEY=...)):
    the literal pieces around NAME and each KEY, `sep` between parameters, the required
    ones first and always, then the others, each optional. A string's value is `text` with
    its TEXT the string (`body`: any text but what ends it; one of its enum's, where it has
    one): the tag families' text as it is, Gemma 4's between <|"|>; text None: JSON, as
    LFM2's Python reads it. Any other value is JSON by its own schema (rule call-I-J). The
    family's reader takes what this writes. body None: any text but the parameter's closing
    tag (until); literal: how the literal pieces are written (loose: line breaks optional);
    values: (rule name, GBNF) of the family's own spelling of an array or an object (Gemma
    4's [<|"|>a<|"|>,1], {key:...}), which their values take instead of JSON."""
    closing = re.findall(r"</[^>]*>", param_close + call_close)
    body = body or (until(*closing) if closing else TAG_TEXT)

    def build(i: str, name: str, params: dict) -> tuple[dict[str, dict], str]:
        props = params.get("properties")
        props = props if isinstance(props, dict) else {}
        required = params.get("required")
        required = set(required) if isinstance(required, list) else set()
        schemas: dict[str, dict | str] = {}
        needed, optional = [], []
        for j, (key, schema) in enumerate(props.items()):
            schema = schema if isinstance(schema, dict) else {}
            kind, enum = schema.get("type"), schema.get("enum")
            string = kind == "string" or kind == ["string"]
            if string and text is not None and isinstance(enum, list) and enum \
                    and all(isinstance(e, str) for e in enum):
                value = text.replace("TEXT", "(" + " | ".join(lit(e) for e in enum) + ")")
            elif string and text is not None:
                value = text.replace("TEXT", body)
            elif values is not None and kind in ("array", "object"):
                value, schemas[values[0]] = values  # the family's own containers
            else:
                value = f"call-{i}-{j}"
                # (anyOf: a rule of its own name, which a bare primitive does not get)
                schemas[value] = {"anyOf": [schema]}
            one = f"{literal(param_open.replace('KEY', key))} {value}" + (
                f" {literal(param_close)}" if param_close else "")
            (needed if key in required else optional).append(one)
        return schemas, " ".join([literal(call_open.replace("NAME", name)),
                                  *keyed(needed, optional, sep), literal(call_close)])
    return build


ANY_ORDER = 3  # needed parameters up to this many may come in any order (3! = 6 ways)


def keyed(needed: list[str], optional: list[str], sep: str) -> list[str]:
    """Parameters, `sep` between two: the needed ones (in any order, up to ANY_ORDER of
    them: test-chat.cpp's Qwen3-Coder edit writes newString first), then each optional one
    in order."""
    s = f"{lit(sep)} " if sep else ""
    if needed:
        orders = itertools.permutations(needed) if len(needed) <= ANY_ORDER else [needed]
        ways = [f" {s}".join(order) for order in orders]
        first = ways[0] if len(ways) == 1 else "(" + " | ".join(f"({w})" for w in ways) + ")"
        return [first, *(f"({s}{o})?" for o in optional)]
    if not optional:
        return []
    if not sep:
        return [f"({o})?" for o in optional]
    # no needed one: the first written has no separator before it
    starts = [" ".join([o, *(f"({s}{p})?" for p in optional[k + 1:])])
              for k, o in enumerate(optional)]
    return ["(" + " | ".join(f"({x})" for x in starts) + ")?"]


# Gemma 4's values: a string between its quote, and an array's or an object's value as it
# writes them (test-chat.cpp's todos:[<|"|>buy milk<|"|>,...], config:{theme:<|"|>dark
# <|"|>,count:3}): strings quoted its way, bare keys (toolcall's gemma4 family)
GEMMA4_QUOTE = '<|"|>'
GEMMA4_TEXT = '([^<] | "<" [^|])*'  # a string's text: up to the closing quote
_GEMMA4_KEY = "[A-Za-z_] [A-Za-z0-9_-]*"
GEMMA4_VALUE = ("gemma4-value", " | ".join([
    f"{lit(GEMMA4_QUOTE)} {GEMMA4_TEXT} {lit(GEMMA4_QUOTE)}",
    '"-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?', '"true"', '"false"', '"null"',
    '"[" (gemma4-value ("," gemma4-value)*)? "]"',
    f'"{{" ({_GEMMA4_KEY} ":" gemma4-value ("," {_GEMMA4_KEY} ":" gemma4-value)*)? "}}"']))
