"""Chat templates from GGUF files, rendered in Jinja's sandbox, within a budget.

A template is code from a file someone else wrote. The sandbox stops it reaching anything; the
budget stops it hanging or exhausting memory: a deadline checked on every line the template
runs, and a size limit on every string or list it builds (operators, method calls, filters,
`~` joins, a list or dict it grows in place) and on its output. Breaking either is a one-line
UsageError naming the template. As in llama.cpp's Jinja, a template may grow the lists it
builds (`ns.items.append(x)`: Kimi K2's; never what it was handed), and may mark the
assistant's text with transformers' `{% generation %}` tag, which renders its body.
"""

from __future__ import annotations

import contextvars
import json
import re
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache, wraps
from itertools import islice

import jinja2.runtime
from jinja2 import TemplateError, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.nodes import EvalContext
from jinja2.sandbox import SandboxedEnvironment, modifies_known_mutable

from specli.errors import ContextOverflowError, UsageError

# A file without a template gets ChatML, the most common format for small instruct models.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
RENDER_SECONDS = 5.0  # a real template renders a long conversation in milliseconds
RENDER_BYTES = 16 << 20  # the largest string, list or output a template may build
_JOINS = {jinja2.runtime.str_join.__code__, jinja2.runtime.markup_join.__code__}
_DIGITS = re.compile(r"\d+")
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-+ #0]*\d*(?:\.\d+)?")  # "%10.3f"
_BRACES = re.compile(r"\{[^{}]*\}")  # "{:>10}"


class _OverBudget(Exception):
    pass


def _sized(value, limit: int):
    if isinstance(value, str | bytes | list | tuple | dict | set) and len(value) > limit:
        raise _OverBudget(f"it built a value of {len(value)} items (limit {limit})")
    return value


# the filters and str methods whose int arguments are widths or counts of what they build
_WIDTH_FILTERS = {"do_center", "do_indent", "do_truncate", "do_wordwrap"}
_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs"}


def _check_widths(args, kwargs, limit: int) -> None:
    """No width or count argument beyond the size limit (center(10**10), ljust...)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > limit:
            raise _OverBudget(f"an argument of {a} (limit {limit})")


def _check_format(fmt: str, spec: re.Pattern, limit: int, values=()) -> None:
    """No field width or precision beyond the size limit in a format string, nor a `*`
    width taken from the values that is."""
    for field in spec.findall(fmt):
        if any(int(n) > limit for n in _DIGITS.findall(field)):
            raise _OverBudget(f"a format width over {limit}")
    if "*" in fmt:
        _check_widths(values if isinstance(values, tuple) else (values,), {}, limit)


def _check_size(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise _OverBudget(f"{what} of {n} items (limit {limit})")


class _Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's
    tokens for training masks): the body, rendered as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


# the ids of the lists, dicts and sets the render was handed (messages, tools, kwargs'
# values): a template may change what it builds, never those (the caller reuses them, and
# prompt.template_caps's probes are module constants)
_INPUTS: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("_INPUTS",
                                                                        default=frozenset())
_INDENT = 64  # the widest tojson indent (real templates use 2 or 4)


def _containers(*roots) -> frozenset[int]:
    seen, stack = set(), list(roots)
    while stack:
        v = stack.pop()
        if isinstance(v, dict | list | set | tuple) and id(v) not in seen:
            seen.add(id(v))
            # the base classes' own iteration: a Watched probe must not see this as a read
            stack.extend(dict.values(v) if isinstance(v, dict) else
                         list.__iter__(v) if isinstance(v, list) else v)
    return frozenset(seen)


class _Budgeted(SandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

    def is_safe_attribute(self, obj, attr, value) -> bool:
        return super().is_safe_attribute(obj, attr, value) and not (
            id(obj) in _INPUTS.get() and modifies_known_mutable(obj, attr))

    def __init__(self, **kw):
        super().__init__(**kw)
        self.limit = RENDER_BYTES
        for name, f in list(self.filters.items()):
            self.filters[name] = self._guard(f)

    def _guard(self, f):
        name = f.__name__

        @wraps(f)
        def guarded(*args, **kwargs):
            # the value filtered comes after the context for pass_context filters
            values = [a for a in args if not isinstance(a, jinja2.runtime.Context | EvalContext)]
            if name in _WIDTH_FILTERS:
                _check_widths(values[1:], kwargs, self.limit)
            elif name == "do_format" and values and isinstance(values[0], str):
                _check_format(values[0], _PERCENT, self.limit, tuple(values[1:]))
            elif name == "do_join" and values and isinstance(values[0], list | tuple):
                sep = values[1] if len(values) > 1 else kwargs.get("d", "")
                _check_size(sum(len(x) if isinstance(x, str) else 1 for x in values[0])
                            + len(sep) * max(len(values[0]) - 1, 0), self.limit, "a join")
            return _sized(f(*args, **kwargs), self.limit)
        return guarded

    def call_binop(self, context, op: str, left, right):
        limit = self.limit
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if hasattr(seq, "__len__") and isinstance(n, int):
                    _check_size(len(seq) * n, limit, "a repetition")
        elif op == "**" and isinstance(left, int) and isinstance(right, int) and \
                abs(left) > 1 and right > 0 and right * abs(left).bit_length() > 8 * limit:
            raise _OverBudget("a power beyond the size limit")
        elif op == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
            _check_size(len(left) + len(right), limit, "a concatenation")
        elif op == "%" and isinstance(left, str):
            _check_format(left, _PERCENT, limit, right)
        return _sized(super().call_binop(context, op, left, right), limit)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
        limit = __self.limit
        method = getattr(__obj, "__wrapped__", __obj)
        bound, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(bound, str):
            if name in _WIDTH_METHODS:
                _check_widths(args, kwargs, limit)
            elif name in ("format", "format_map"):  # "{:>99999999999}".format(x)
                _check_format(bound, _BRACES, limit)
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and \
                    isinstance(args[1], str):  # "".replace("", s) grows by len(s) a char
                _check_size(len(bound) + bound.count(args[0]) * len(args[1]), limit,
                            "a replacement")
            elif name == "join" and args and isinstance(args[0], list | tuple):
                _check_size(sum(len(x) if isinstance(x, str) else 1 for x in args[0])
                            + len(bound) * max(len(args[0]) - 1, 0), limit, "a join")
        elif getattr(method, "__objclass__", None) is not None and args and \
                id(args[0]) in _INPUTS.get() and modifies_known_mutable(args[0], name):
            # dict.update(messages[0], ...), list.append(messages, ...): the method form is
            # refused by is_safe_attribute, this spelling reaches the same method unbound
            raise SecurityError(f"{name} of an input is unsafe: a template never changes "
                                "what it was handed")
        elif isinstance(bound, list | dict | set):  # a list of its own grown in place: a
            # generator argument is read here, bounded (x.extend(x|map(...)) never ends)
            args = tuple(_sized(list(islice(a, limit + 1)), limit) if isinstance(a, Iterator)
                         else a for a in args)
        out = _sized(super().call(__context, __obj, *args, **kwargs), limit)
        if isinstance(bound, list | dict | set):
            _sized(bound, limit)
        return out


@lru_cache(maxsize=8)
def _compile(source: str, bound: int = RENDER_BYTES):
    # {% break %} and {% continue %}, as llama.cpp's and transformers' templates use them
    env = _Budgeted(trim_blocks=True, lstrip_blocks=True,
                    extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do", _Generation])
    env.limit = bound

    def raise_exception(message):
        raise TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    # JSON as llama.cpp's (and transformers') templates get it: no HTML escaping, the keyword
    # arguments templates pass (Jinja's own escapes <, > and & and takes only indent)
    env.filters["tojson"] = env._guard(_tojson)
    env.filters["safe"] = str  # nothing is escaped here (as in llama.cpp): safe marks nothing
    # llama.cpp's: Llama 3.x templates print today's date
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(str(fmt))
    return env.from_string(source)


class Watched(dict):
    """A dict that notes when a template reads it as an object (its items, a key, its JSON):
    how prompt.template_caps tells a template that wants a call's arguments as an object
    from one that prints them as text, as llama.cpp's caps probe does."""

    read = False

    def _saw(self):
        self.read = True
        return self

    def __getitem__(self, key):
        return dict.__getitem__(self._saw(), key)

    def get(self, key, default=None):
        return dict.get(self._saw(), key, default)

    def items(self):
        return dict.items(self._saw())

    def keys(self):
        return dict.keys(self._saw())

    def values(self):
        return dict.values(self._saw())

    def __iter__(self):
        return dict.__iter__(self._saw())


class WatchedList(list):
    """A list that notes when a template reads it (a conversation's tool_calls: whether a
    template renders them at all, as llama.cpp's caps probe counts a value used)."""

    read = False

    def _saw(self):
        self.read = True
        return self

    def __iter__(self):
        return list.__iter__(self._saw())

    def __getitem__(self, i):
        return list.__getitem__(self._saw(), i)

    def __len__(self):
        return list.__len__(self._saw())


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:
    if indent is not None and len(indent if isinstance(indent, str) else " " * min(
            int(indent), _INDENT + 1)) > _INDENT:
        raise _OverBudget(f"a tojson indent of more than {_INDENT}")
    _seen(value)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, default=_as_list,
                      separators=tuple(separators) if separators else None, sort_keys=sort_keys)


def _as_list(value):
    """What Jinja's map, select and selectattr give is a generator, which llama.cpp's Jinja
    makes an array: `tools | map(attribute='function') | tojson` (llama.cpp's DeepSeek R1
    template) prints the list."""
    if isinstance(value, Iterator):
        out = list(value)
        _seen(out)
        return out
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _seen(value, depth: int = 0) -> None:
    if isinstance(value, Watched | WatchedList):
        value.read = True
    if depth < 8 and isinstance(value, dict | list | tuple):
        for v in value.values() if isinstance(value, dict) else value:
            _seen(v, depth + 1)


def template_context(kwargs: dict | None = None) -> dict:
    """The variables llama.cpp gives every template besides the messages: the date in the
    two forms templates read (Llama 3.x's date_string, firefunction's datetime),
    enable_thinking (on unless kwargs say otherwise), whether earlier turns keep their
    reasoning (kwargs' preserve_reasoning, on by default) and the reasoning effort under its
    second name; then the request's chat_template_kwargs, each a variable of its own."""
    now = datetime.now()
    kwargs = kwargs or {}
    ctx = {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y"),
           "enable_thinking": True}
    keep = kwargs.get("preserve_reasoning", True)
    if isinstance(keep, bool):  # llama.cpp's --reasoning-preserve (on by default): the names
        # templates read for keeping earlier turns' reasoning in the history (GLM 4.7's
        # clear_thinking, DeepSeek V4's drop_thinking, ...)
        ctx.update(preserve_thinking=keep, clear_thinking=not keep,
                   truncate_history_thinking=not keep, drop_thinking=not keep)
    effort = kwargs.get("reasoning_effort")
    if isinstance(effort, str) and effort:
        ctx["reasoning_strength"] = effort  # llama.cpp binds both names to the effort
    return {**ctx, **kwargs}


def render_here(template: str | None, messages: list[dict], bos: str, eos: str,
                seconds: float, max_bytes: int | None, bound: int = RENDER_BYTES,
                add_generation_prompt: bool = True, context: dict | None = None) -> str:
    """The render itself, in this process (template_host's child): the sandbox, a deadline
    on every line the template runs, `bound` on every value it builds, and on the output
    `max_bytes` (what the context holds; else the bound)."""
    limit = bound if max_bytes is None else max_bytes
    hint = "run without --chat and format the prompt yourself"
    try:
        compiled = _compile(template or FALLBACK_TEMPLATE, bound)
    except Exception as e:  # noqa: BLE001 - a template that does not compile
        raise UsageError(f"the model's chat template does not compile: {e}", hint=hint) from e
    deadline = time.monotonic() + seconds

    def on_line(frame, event, arg):
        if event == "return" and frame.f_code in _JOINS:
            _sized(arg, bound)  # the output's own bound (max_bytes) is checked below
        elif time.monotonic() > deadline:
            raise _OverBudget(f"it ran for more than {seconds:g} s")
        return on_line

    def on_call(frame, event, arg):
        code = frame.f_code
        return on_line if code.co_filename == "<template>" or code in _JOINS else None

    variables = {**(context or {}), "messages": messages,
                 "add_generation_prompt": add_generation_prompt, "bos_token": bos,
                 "eos_token": eos}
    inputs = _INPUTS.set(_containers(variables))
    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        parts, size = [], 0
        for piece in compiled.generate(variables):
            size += len(piece)
            if size > limit:
                if max_bytes is not None:  # the caller's bound: what the context can hold
                    raise ContextOverflowError(
                        f"the conversation renders to more than {limit} characters, more "
                        "than the context can hold", hint="shorten the conversation or raise "
                        "-c/--ctx-size")
                raise _OverBudget(f"its output passed {limit} characters")
            parts.append(piece)
        return "".join(parts)
    except ContextOverflowError:
        raise
    except _OverBudget as e:
        raise UsageError(f"the model's chat template was stopped: {e}", hint=hint) from None
    except RecursionError:
        raise UsageError("the model's chat template was stopped: it recursed too deeply",
                         hint=hint) from None
    except MemoryError:  # the templates' process is under a memory limit (template_host)
        raise UsageError("the model's chat template was stopped: it needed more memory "
                         "than a template may take", hint=hint) from None
    except Exception as e:  # noqa: BLE001 - the sandbox stops anything worse than a failure
        kind = "" if isinstance(e, TemplateError) else f"{type(e).__name__}: "
        raise UsageError(f"the model's chat template failed: {kind}{e}", hint=hint) from e
    finally:
        sys.settrace(previous)
        _INPUTS.reset(inputs)


# -- what a template does (llama.cpp's caps probe) -------------------------------------------

PROBE_CALL = {"id": "call00001", "type": "function",
              "function": {"name": "FFF_FIRST_FUN_F", "arguments": '{"AA_ARG_FST_AA": "BB"}'}}
PROBE_TOOL = {"type": "function", "function": {
    "name": "FFF_FIRST_FUN_F", "description": "A probe",
    "parameters": {"type": "object", "required": ["AA_ARG_FST_AA"], "properties": {
        "AA_ARG_FST_AA": {"type": "string", "description": "An argument"}}}}}


def caps_here(template: str | None, seconds: float) -> list[bool]:
    """What a template does, found by rendering it (as llama.cpp's caps probe): [renders a
    system message, renders assistant tool calls, wants a call's arguments as an object
    rather than JSON text]. In template_host's child: prompt.template_caps asks there."""

    def probe(messages: list[dict]) -> str | None:
        ctx = {**template_context(), "tools": [PROBE_TOOL], "functions": ""}
        try:  # a real template renders these in milliseconds: a hostile one is no longer
            return render_here(template, messages, "", "", seconds, None,
                               add_generation_prompt=False, context=ctx)
        except UsageError:
            return None

    system = probe([{"role": "system", "content": "SSS_SYSTEM_S"},
                    {"role": "user", "content": "UUU"}]) or ""
    user = {"role": "user", "content": "UUU"}
    args = Watched({"AA_ARG_FST_AA": "BB"})
    calls = WatchedList([{**PROBE_CALL, "function": {**PROBE_CALL["function"],
                                                     "arguments": args}}])
    as_object = probe([user, {"role": "assistant", "content": "", "tool_calls": calls}])
    as_text = probe([user, {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}])
    # a template renders calls if it reads them at all (llama.cpp's "used"), even where
    # this probe's message does not show them (DeepSeek R1's want no content beside)
    renders = calls.read or any(t is not None and "FFF_FIRST_FUN_F" in t
                                for t in (as_text, as_object))
    objects = renders and (args.read or as_text is None)
    return ["SSS_SYSTEM_S" in system, renders, objects]
