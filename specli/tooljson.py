"""JSON and text as a model writes them into a tool call: strict JSON read at a position,
a value's JSON text, arguments that must be an object, text that may still grow into a
marker, a string's body cut short. The standard library alone (toolcall.py reads with it)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # as llama.cpp's reader (nlohmann) refuses it


# strict JSON, as a client reads the arguments back: NaN and Infinity are not numbers there
DECODER = json.JSONDecoder(parse_constant=_no_constant)


def json_at(text: str, at: int) -> tuple[object, int] | None:
    """The JSON value starting at `at` (after blanks) and where it ends; None if it is not
    complete there."""
    n = len(text)
    while at < n and text[at] in " \t\r\n":
        at += 1
    try:
        value, end = DECODER.raw_decode(text, at)
    except (ValueError, RecursionError):  # deeper than the decoder goes: no value either
        return None
    return value, end


def json_text(value) -> str | None:
    """value as JSON text, or None where it has none: what a model may write that only
    Python reads (a complex number, a set, an Ellipsis), an integer past Python's limit on
    converting digits, NaN, or nesting past the encoder's depth."""
    try:
        return utf8_safe(json.dumps(value, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return None


def utf8_safe(text: str) -> str:
    """text with any lone UTF-16 surrogate (a model's JSON may spell one, "\\ud800") as
    U+FFFD: no UTF-8 encoder takes it, and a client's reply is UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def args_text(value) -> str | None:
    """A call's arguments as the JSON text of an object, from an object or from text that
    holds one (OpenAI's own form); None for anything else (a string that is no object, an
    array, a number, a value with no JSON form): no call, the answer stays text."""
    if value is None:
        value = {}  # null: a call without arguments
    if isinstance(value, str):
        try:
            value = DECODER.decode(value) if value.strip() else {}
        except (ValueError, RecursionError):
            return None
    return json_text(value) if isinstance(value, dict) else None


def held(text: str, markers: Sequence[str]) -> str:
    """text without a tail that may still grow into one of the markers."""
    cut = len(text)
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut]


STRING_BODY = re.compile(r'(?:[^"\\]|\\u[0-9a-fA-F]{4}|\\[^u])*')


def partial_string(s: str) -> str:
    """The decoded part of a JSON string's body that has arrived (up to its closing quote,
    not into an escape cut short)."""
    i = STRING_BODY.match(s).end()
    try:
        out = json.loads('"' + s[:i] + '"')
    except ValueError:
        return ""
    if out and "\ud800" <= out[-1] <= "\udbff":  # a pair's first half: its second may come
        out = out[:-1]
    return utf8_safe(out)
