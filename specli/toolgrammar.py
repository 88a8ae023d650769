"""The GBNF a template family's required tool call is written in, built from literal pieces
around the tool's name and arguments (toolcall.FAMILIES declares each family's with these;
toolcall.grammar_parts puts a request's tools through them): a JSON call's pieces (seq,
obj), a call written a parameter at a time (tags), and how calls follow each other (repeat,
around). GBNF text only: the schemas are converted where the grammar is built
(backend.schemas_grammar)."""

from __future__ import annotations

import json
from collections.abc import Callable


def lit(s: str) -> str:
    """A GBNF string literal."""
    out = json.dumps(s, ensure_ascii=False)
    return out.replace("\\/", "/")


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


def repeat(sep: str = "") -> Callable[[str, bool], str]:
    def wrap(call: str, parallel: bool) -> str:
        # (the alternation in parentheses: a separator before any call, not the first tool's)
        more = f" ({lit(sep) + ' ' if sep else ''}({call}))*" if parallel else ""
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
          sep: str = "", text: str | None = "TEXT", body: str = TAG_TEXT
          ) -> Callable[[str, str, dict], tuple[dict[str, dict], str]]:
    """A call written a parameter at a time (Qwen3-Coder's <function=NAME><parameter=KEY>,
    GLM's <arg_key>, MiniMax's <invoke>, Gemma 4's call:NAME{KEY:...}, LFM2's NAME(KEY=...)):
    the literal pieces around NAME and each KEY, `sep` between parameters, the required
    ones first and always, then the others, each optional. A string's value is `text` with
    its TEXT the string (`body`: any text but what ends it; one of its enum's, where it has
    one): the tag families' text as it is, Gemma 4's between <|"|>; text None: JSON, as
    LFM2's Python reads it. Any other value is JSON by its own schema (rule call-I-J). The
    family's reader takes what this writes."""
    def build(i: str, name: str, params: dict) -> tuple[dict[str, dict], str]:
        props = params.get("properties")
        props = props if isinstance(props, dict) else {}
        required = params.get("required")
        required = set(required) if isinstance(required, list) else set()
        schemas: dict[str, dict] = {}
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
            else:
                value = f"call-{i}-{j}"
                # (anyOf: a rule of its own name, which a bare primitive does not get)
                schemas[value] = {"anyOf": [schema]}
            one = f"{lit(param_open.replace('KEY', key))} {value}" + (
                f" {lit(param_close)}" if param_close else "")
            (needed if key in required else optional).append(one)
        return schemas, " ".join([lit(call_open.replace("NAME", name)),
                                  *keyed(needed, optional, sep), lit(call_close)])
    return build


def keyed(needed: list[str], optional: list[str], sep: str) -> list[str]:
    """Parameters in order, `sep` between two: the needed ones, then each optional one."""
    s = f"{lit(sep)} " if sep else ""
    if needed:
        return [f" {s}".join(needed), *(f"({s}{o})?" for o in optional)]
    if not optional:
        return []
    if not sep:
        return [f"({o})?" for o in optional]
    # no needed one: the first written has no separator before it
    starts = [" ".join([o, *(f"({s}{p})?" for p in optional[k + 1:])])
              for k, o in enumerate(optional)]
    return ["(" + " | ".join(f"({x})" for x in starts) + ")?"]
