"""Sampling: config.SAMPLING's flags, derived from the declaration, and llama.cpp's list
flags (--dry-sequence-breaker, -l/--logit-bias).
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Annotated, Any

import typer

from specli import config
from specli.cli.options.group import SAMPLING, Group
from specli.errors import UsageError

_SP = config.SamplingParams


def _sampling_flags(**kw: Any) -> config.SamplingParams:
    """The sampling flags (config.SAMPLING's, and llama.cpp's list flags) as SamplingParams,
    which checks them; a negative seed means a fresh random one."""
    breakers, bias = kw.pop("dry_sequence_breaker"), kw.pop("logit_bias")
    try:
        return config.SamplingParams(
            **{k.field: k.read(kw[k.field]) for k in config.SAMPLING},
            logit_bias=tuple(_logit_bias(v) for v in bias or ()),
            dry_sequence_breakers=_SP.dry_sequence_breakers if breakers is None else ()
            if breakers == ["none"] else tuple(breakers))
    except config.SamplingError as e:
        raise UsageError(e.named(next(f for f in e.knob.flags if f.startswith("--")))) \
            from None


def _option(knob: config.Knob) -> inspect.Parameter:
    """A knob's flag as a Typer parameter; a field whose default is None (the seed: a random
    one) shows -1 there."""
    default = getattr(_SP, knob.field)
    return inspect.Parameter(
        knob.field, inspect.Parameter.POSITIONAL_OR_KEYWORD,
        default=-1 if default is None else default,
        annotation=Annotated[knob.kind, typer.Option(
            *knob.flags, help=knob.help, envvar=knob.envvar, rich_help_panel=SAMPLING)])


_FLAG = inspect.Parameter.POSITIONAL_OR_KEYWORD


_sampling_flags.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
    *map(_option, config.SAMPLING),
    inspect.Parameter("dry_sequence_breaker", _FLAG, default=None,
                      annotation=Annotated[list[str] | None, typer.Option(
                          "--dry-sequence-breaker", help="DRY sequence breaker, replacing the "
                          "defaults; repeatable; 'none' for none.", rich_help_panel=SAMPLING)]),
    inspect.Parameter("logit_bias", _FLAG, default=None,
                      annotation=Annotated[list[str] | None, typer.Option(
                          "-l", "--logit-bias", metavar="TOKEN_ID(+/-)BIAS",
                          help="Add BIAS to a token's logit, e.g. 15043+1 or 15043-inf; "
                          "repeatable.", rich_help_panel=SAMPLING)]),
], return_annotation=config.SamplingParams)


def _logit_bias(value: str) -> tuple[int, float]:
    """llama.cpp's TOKEN_ID(+/-)BIAS: 15043+1, 15043-1.5, 15043-inf."""
    m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(\S+)\s*", value)
    try:
        if m is None:
            raise ValueError
        bias = float(m.group(3))
        if math.isnan(bias):
            raise ValueError
    except ValueError:
        raise UsageError(f"--logit-bias {value!r} is not TOKEN_ID(+/-)BIAS",
                         hint="e.g. --logit-bias 15043+1 or --logit-bias 15043-inf") from None
    return int(m.group(1)), -bias if m.group(2) == "-" else bias


SAMPLING_FLAGS = Group(_sampling_flags)
