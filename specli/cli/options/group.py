"""How a command takes its flags: each group declared once, as a function whose Annotated
parameters are its flags and whose result is one frozen config object (llama.cpp parses one
common_params the same way). A command names the groups it takes as parameters whose
default is the group; `@grouped` splices the group's flags into the command's signature in
their place (Typer reads __signature__) and hands the command the parsed object. Also the
help panels, and the one-flag declarations several commands share.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated, Any

import typer

from specli.errors import UsageError

MODELS = "Models"
DRAFTING = "Drafting"
SAMPLING = "Sampling"
RESOURCES = "Context and threads"
OUTPUT = "Output"
NGRAM = "n-gram drafting"
GPU = "GPU placement"


@dataclass(frozen=True)
class Group:
    """Flags declared once (the parse function's parameters), parsed into one object.
    with_defaults: a command's own defaults for some of them (check-pair's -c 2048)."""

    parse: Callable[..., Any]
    defaults: tuple[tuple[str, Any], ...] = ()

    def with_defaults(self, **kw: Any) -> Group:
        return replace(self, defaults=self.defaults + tuple(kw.items()))

    def params(self) -> list[inspect.Parameter]:
        own = dict(self.defaults)
        params = list(inspect.signature(self.parse, eval_str=True).parameters.values())
        if set(own) - {p.name for p in params}:
            raise TypeError(f"{self.parse.__name__} has no flag {set(own)}")
        return [p.replace(default=own[p.name]) if p.name in own else p for p in params]


def grouped(command):
    """Splice the flags of each group a command takes (a parameter whose default is a Group)
    into its signature in that place; the command receives each group parsed."""
    sig = inspect.signature(command, eval_str=True)
    groups = {n: p.default for n, p in sig.parameters.items() if isinstance(p.default, Group)}
    flags = {n: g.params() for n, g in groups.items()}
    params = [q for n, p in sig.parameters.items() for q in flags.get(n, [p])]

    def wrapper(**kw):
        for name, group in groups.items():
            kw[name] = group.parse(**{q.name: kw.pop(q.name) for q in flags[name]})
        return command(**kw)

    wrapper.__name__, wrapper.__doc__ = command.__name__, command.__doc__
    wrapper.__module__, wrapper.__qualname__ = command.__module__, command.__qualname__
    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.command = command  # type: ignore[attr-defined]  # its groups unexpanded
    return wrapper


Json = Annotated[bool, typer.Option(
    "--json", help="Print one JSON object on stdout: text and every statistic.",
    rich_help_panel=OUTPUT)]


Verbose = Annotated[bool, typer.Option(
    "-v", "--verbose", help="Show llama.cpp's own log on stderr (serve: and, as "
    "llama-server -v, a __verbose object in every chat and completions answer).",
    rich_help_panel=OUTPUT)]


NoSpec = Annotated[bool, typer.Option(
    "--no-spec", help="Decode with the target alone.", rich_help_panel=DRAFTING)]


def check_n_predict(n_predict: int) -> None:
    """Before any model loads: -1 (unlimited) or a number of tokens; 0 would load and
    prefill to generate nothing."""
    if n_predict < -1:
        raise UsageError(f"-n/--n-predict must be -1 (unlimited) or more, got {n_predict}")
    if n_predict == 0:
        raise UsageError("-n 0 generates nothing", hint="give a number of tokens, or -1 until "
                         "the end of generation")
