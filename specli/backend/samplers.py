"""llama.cpp's samplers that hold state: a GBNF grammar (used as a test of which tokens may
come next) and DRY; and the bounds a grammar is checked against before llama.cpp parses it."""

from __future__ import annotations

import ctypes
import functools
import json
import re
from typing import Protocol

import numpy as np

from specli.backend._lib import clear_error, last_error, ll
from specli.errors import UsageError


class Vocabulary(Protocol):
    """A model or a tokenizer: what a sampler is made over."""

    vocab: object  # its llama_vocab


class Context(Vocabulary, Protocol):
    n_ctx: int

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data


class _Sampler:
    """A llama.cpp sampler whose state moves with accepted tokens: apply it to candidates,
    accept a token, fork (clone) the state, free it."""

    _s = None

    def _apply(self, data: np.ndarray) -> None:
        """Run the sampler over a _TOKEN_DATA array, in place."""
        arr = ll.llama_token_data_array(
            data.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)), len(data), -1, False)
        ll.llama_sampler_apply(self._s, ctypes.byref(arr))

    def _clone(self):
        return ll.llama_sampler_clone(self._s)

    def accept(self, token: int) -> None:
        ll.llama_sampler_accept(self._s, token)

    def close(self) -> None:
        if self._s:
            ll.llama_sampler_free(self._s)
            self._s = None

    def __del__(self) -> None:
        self.close()


class Grammar(_Sampler):
    """A GBNF grammar's parse state over a model's vocabulary (llama.cpp's grammar sampler).
    `allowed` asks which candidate tokens may come next; `accept` moves past a token, which
    must be one it allowed (llama.cpp aborts the process otherwise); `fork` copies the state,
    for a draft or a verification to walk ahead without moving the committed one."""

    def __init__(self, model: Vocabulary | None, gbnf: str | None,
                 root: str = "root", _handle=None):
        if _handle is None:
            _check_nesting(gbnf)
            clear_error()
            texts = lazy_triggers(gbnf)
            triggers = trigger_tokens(model, texts)
            if texts and not triggers:
                raise UsageError("a lazy grammar's triggers are no token of this vocabulary")
            if triggers:  # off until one of these tokens is written, then from it on
                _handle = ll.llama_sampler_init_grammar_lazy_patterns(
                    model.vocab, gbnf.encode(), root.encode(), None, 0,
                    (ll.llama_token * len(triggers))(*triggers), len(triggers))
            else:
                _handle = ll.llama_sampler_init_grammar(model.vocab, gbnf.encode(),
                                                        root.encode())
            if not _handle:
                why = last_error() or "llama.cpp could not parse it"
                raise UsageError(f"the grammar is not valid GBNF: {why}",
                                 hint="see llama.cpp's grammars/README.md")
        self._s = _handle

    def fork(self) -> Grammar:
        return Grammar(None, None, _handle=self._clone())

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        """A mask over `ids`: True where the grammar lets the token come next."""
        data = np.zeros(len(ids), dtype=_TOKEN_DATA)
        data["id"] = ids
        self._apply(data)
        return np.isfinite(data["logit"])


class Dry(_Sampler):
    """llama.cpp's DRY sampler ("don't repeat yourself"): penalizes the token that would
    extend a repetition of what it has accepted. `apply` returns the row changed (the
    sampler neither reorders nor resizes the candidates); `fork` copies the state."""

    def __init__(self, model: Context | None, sp=None, _handle=None):
        if _handle is None:
            breakers = [b.encode() for b in sp.dry_sequence_breakers]
            arr = (ctypes.c_char_p * max(len(breakers), 1))(*breakers)
            n_last = sp.dry_penalty_last_n if sp.dry_penalty_last_n >= 0 else model.n_ctx
            _handle = ll.llama_sampler_init_dry(model.vocab, sp.dry_multiplier, sp.dry_base,
                                                sp.dry_allowed_length, n_last, arr,
                                                len(breakers))
            if not _handle:
                raise UsageError("llama.cpp refused the DRY settings")
        self._s = _handle

    def fork(self) -> Dry:
        return Dry(None, _handle=self._clone())

    def apply(self, row: np.ndarray) -> np.ndarray:
        data = np.empty(row.shape[0], dtype=_TOKEN_DATA)
        data["id"] = _ids(row.shape[0])
        data["logit"] = row
        data["p"] = 0.0
        self._apply(data)
        return data["logit"].copy()


@functools.lru_cache(maxsize=4)
def _ids(n: int) -> np.ndarray:
    """0..n-1, made once per vocabulary size."""
    return np.arange(n, dtype=np.int32)


GRAMMAR_MAX_NESTING = 256
GRAMMAR_MAX_RULES = 4096


def _check_nesting(gbnf: str) -> None:
    """Refuse a grammar nested deeper than GRAMMAR_MAX_NESTING parentheses: llama.cpp's parser
    recurses once per level, and a hostile depth would overflow the C stack. Likewise more
    than GRAMMAR_MAX_RULES rules (a chain of rules is walked recursively)."""
    if gbnf.count("::=") > GRAMMAR_MAX_RULES:
        raise UsageError(f"the grammar has more than {GRAMMAR_MAX_RULES} rules")
    depth, quote, i = 0, None, 0
    while i < len(gbnf):
        c = gbnf[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"[":
            quote = "]" if c == "[" else c
        elif c == "#":  # a comment runs to the end of the line
            j = gbnf.find("\n", i)
            i = len(gbnf) if j < 0 else j
        elif c == "(":
            depth += 1
            if depth > GRAMMAR_MAX_NESTING:
                raise UsageError(f"the grammar nests parentheses more than "
                                 f"{GRAMMAR_MAX_NESTING} deep")
        elif c == ")":
            depth = max(depth - 1, 0)
        i += 1


# a grammar whose first line is this, then a JSON list of texts, is lazy (llama.cpp's): no
# constraint until the output writes one of the texts, then the grammar from that text on
LAZY = "# specli: lazy from "


def lazy_triggers(gbnf: str) -> list[str]:
    if not gbnf.startswith(LAZY):
        return []
    try:
        value = json.loads(gbnf[len(LAZY):gbnf.find("\n")])
    except ValueError:
        return []
    return [t for t in value if isinstance(t, str) and t] if isinstance(value, list) else []


def trigger_tokens(model: Vocabulary, texts: list[str]) -> list[int]:
    """The triggers that are one token of the model's vocabulary (a tool call's opener is
    a special token in the models trained to write it: <tool_call>, [TOOL_CALLS]...). A
    text trigger would be matched by std::regex over the whole output at every token, which
    grows with the answer (and recurses as deep); the server uses no lazy grammar there."""
    out = []
    for t in texts:
        data = t.encode("utf-8")
        buf = (ll.llama_token * 2)()
        if ll.llama_tokenize(model.vocab, data, len(data), buf, 2, False, True) == 1:
            out.append(buf[0])
    return out


def schemas_grammar(schemas: dict[str, dict | str], root: str, triggers: list[str] = ()
                    ) -> str:
    """JSON schemas as GBNF rules, each under its own name (a tool's call), and `root` over
    them (toolcall.grammar_parts): llama-cpp-python's converter, as schema_grammar; a rule
    given as text (a family's own value syntax, Gemma 4's) is GBNF as it is. With triggers,
    the grammar is lazy: it applies from the first of them the model writes."""
    from llama_cpp.llama_grammar import SchemaConverter

    conv = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    raw = "".join(f"{name} ::= {rule}\n" for name, rule in schemas.items()
                  if isinstance(rule, str))
    try:
        for name, schema in schemas.items():
            if isinstance(schema, str):
                continue
            if conv.visit(conv.resolve_refs(schema, name), name) != name:
                raise ValueError(f"rule {name} named twice")
    except (ValueError, TypeError, KeyError, AssertionError, NotImplementedError,
            RecursionError, AttributeError) as e:
        raise UsageError(f"a tool's parameters cannot be turned into a grammar: {e}") from None
    head = f"{LAZY}{json.dumps(list(triggers))}\n" if triggers else ""
    return f"{head}root ::= {root}\n{raw}{json_chars(conv.format_grammar())}"


# llama-cpp-python's converter lets a JSON string hold raw control characters (a newline, a
# tab): what the model writes there is then no JSON, and no reader takes the call. llama.cpp's
# own converter (common/json-schema-to-grammar.cpp) leaves them out, as JSON does.
_LOOSE_CHAR = re.compile(r'^char ::= \[\^"\\\\\] \|', re.M)
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'


def json_chars(gbnf: str) -> str:
    """The converter's grammar with JSON's string characters: no control characters raw."""
    return _LOOSE_CHAR.sub(lambda _: _JSON_CHAR, gbnf)


def schema_grammar(schema: dict) -> str:
    """A JSON schema as GBNF, by llama-cpp-python's converter (llama.cpp's own, in Python);
    UsageError naming what it cannot convert."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return json_chars(json_schema_to_gbnf(json.dumps(schema)))
    except (ValueError, TypeError, KeyError, AssertionError, NotImplementedError,
            RecursionError) as e:
        raise UsageError(f"the JSON schema cannot be turned into a grammar: {e}") from None
