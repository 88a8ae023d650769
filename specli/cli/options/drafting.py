"""Drafting: what drafts (--spec-type, the n-gram settings) and how much (--draft and its
neighbours), checked, and the plan they make.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any

import typer

from specli import config
from specli.errors import UsageError

if TYPE_CHECKING:
    from specli.plan import SpecPlan

from specli.cli.options.group import DRAFTING, NGRAM, Group


@dataclass(frozen=True)
class Drafting:
    """--spec-type's list, the draft lengths (--draft, --draft-min, --draft-p-min) and the
    n-gram settings."""

    types: tuple[str, ...] = ()
    params: config.DraftPolicy = config.DraftPolicy()
    ngram: config.NgramParams = config.NgramParams()


# each plan setting by its flag (config.PlanError.said), and what to do about it
FLAGS = {**{k.field: k.flags[0] for k in config.DRAFTING}, "types": "--spec-type",
         "draft": "-md", "sampling": "--spec-sampling"}
PLAN_HINTS = {"types": "check --spec-type", "draft": "add -md FILE",
              "n_max": "give --draft N (1 or more) or auto; --no-spec decodes with the "
              "target alone",
              "n_min": "--draft-min is at most --draft", "p_min": None,
              "n_seq": "a tree takes a fixed --draft N", "p_split": None,
              "sampling": None,
              "slots": "fewer -np slots or a smaller --draft-n-seq",
              "head": "give the head's GGUF with -md FILE, or its published checkpoint with "
              "-hfd REPO (converted against -m; `specli convert-head` does it by hand); "
              "README, Draft heads, lists who publishes heads for which models"}


def refused(e: config.PlanError, **names: str) -> UsageError:
    """A plan's error in the flags' words (names: a command's own flag for a field)."""
    return UsageError(e.said({**FLAGS, **names}), hint=PLAN_HINTS.get(e.field))


def plan(drafting: Drafting, model_draft: str | None) -> SpecPlan:
    """The drafting flags as one plan, checked before any model loads (the one resolution
    of a command); its errors name the flags."""
    from specli.plan import SpecPlan, draft_head

    try:
        return SpecPlan.resolve(drafting.types, model_draft is not None, drafting.params,
                                drafting.ngram, draft_head(model_draft))
    except config.PlanError as e:
        raise refused(e) from None


def _ngram_opt(*names: str, help: str):
    return typer.Option(*names, help=help, rich_help_panel=NGRAM, show_default=False)


_NG = config.NgramParams


def _drafting_flags(
    spec_type: Annotated[str | None, typer.Option(
        "--spec-type", help="Speculation types, comma-separated (llama.cpp names): "
        + ", ".join(config.SPEC_TYPES) + ". n-gram drafts take precedence in that order; the "
        "draft model (-md) fills in when none has a proposal. draft-translate: a draft model "
        "with another tokenizer, its drafts converted through text (as --draft-translate).",
        envvar="LLAMA_ARG_SPEC_TYPE",
        rich_help_panel=DRAFTING, show_default=False)] = None,
    ngram_size_n: Annotated[int | None, _ngram_opt(
        "--spec-ngram-size-n", help="Key n-gram length for ngram-simple, -map-k and -map-k4v "
        "(llama.cpp's older spelling; the per-type flags below override it). Default: 12.")] = None,
    ngram_size_m: Annotated[int | None, _ngram_opt(
        "--spec-ngram-size-m", help="Most tokens one match drafts, for the same types. "
        "Default: 48.")] = None,
    ngram_min_hits: Annotated[int | None, _ngram_opt(
        "--spec-ngram-min-hits", help="Lookups of a key before ngram-map-k4v drafts from it. "
        "Default: 1.")] = None,
    simple_size_n: Annotated[int | None, _ngram_opt(
        "--spec-ngram-simple-size-n", help="ngram-simple's n.")] = None,
    simple_size_m: Annotated[int | None, _ngram_opt(
        "--spec-ngram-simple-size-m", help="ngram-simple's m.")] = None,
    simple_min_hits: Annotated[int | None, _ngram_opt(
        "--spec-ngram-simple-min-hits", help="Accepted for llama.cpp compatibility; "
        "ngram-simple does not use it.")] = None,
    map_k_size_n: Annotated[int | None, _ngram_opt(
        "--spec-ngram-map-k-size-n", help="ngram-map-k's n.")] = None,
    map_k_size_m: Annotated[int | None, _ngram_opt(
        "--spec-ngram-map-k-size-m", help="ngram-map-k's m.")] = None,
    map_k_min_hits: Annotated[int | None, _ngram_opt(
        "--spec-ngram-map-k-min-hits", help="ngram-map-k's min hits (as in llama.cpp, map-k "
        "drafts on the first hit).")] = None,
    map_k4v_size_n: Annotated[int | None, _ngram_opt(
        "--spec-ngram-map-k4v-size-n", help="ngram-map-k4v's n.")] = None,
    map_k4v_size_m: Annotated[int | None, _ngram_opt(
        "--spec-ngram-map-k4v-size-m", help="ngram-map-k4v's m.")] = None,
    map_k4v_min_hits: Annotated[int | None, _ngram_opt(
        "--spec-ngram-map-k4v-min-hits", help="ngram-map-k4v's min hits.")] = None,
    ngram_mod_n_match: Annotated[int, typer.Option(
        "--spec-ngram-mod-n-match", help="ngram-mod lookup length.",
        rich_help_panel=NGRAM)] = _NG.mod_n_match,
    ngram_mod_n_max: Annotated[int, typer.Option(
        "--spec-ngram-mod-n-max", help="Most tokens ngram-mod drafts.",
        rich_help_panel=NGRAM)] = _NG.mod_n_max,
    ngram_mod_n_min: Annotated[int, typer.Option(
        "--spec-ngram-mod-n-min", help="ngram-mod drops a draft shorter than this.",
        rich_help_panel=NGRAM)] = _NG.mod_n_min,
    lookup_cache_static: Annotated[str | None, typer.Option(
        "-lcs", "--lookup-cache-static", help="Static lookup cache for ngram-cache (built by "
        "`specli lookup create`; never written). Implies --spec-type ngram-cache.",
        rich_help_panel=NGRAM, show_default=False)] = None,
    lookup_cache_dynamic: Annotated[str | None, typer.Option(
        "-lcd", "--lookup-cache-dynamic", help="Dynamic lookup cache for ngram-cache: read if "
        "it exists, updated atomically after the run. Implies --spec-type ngram-cache.",
        rich_help_panel=NGRAM, show_default=False)] = None,
    draft_translate: Annotated[bool, typer.Option(
        "--draft-translate", help="The draft model (-md) has another tokenizer: its drafts "
        "are turned into text and the text into the target's tokens, which the target "
        "verifies (a pair llama.cpp refuses; it accepts less than a same-family draft).",
        rich_help_panel=DRAFTING)] = False,
    spec_sampling: Annotated[str, typer.Option(
        "--spec-sampling", help="How a sampled draft is verified (temperature above 0). "
        "exact: the target's own seeded sample at each position, a drafted token accepted "
        "while it equals it, as llama-server does: -s gives the same text with or without "
        "a draft. rejection: Leviathan/Chen rejection sampling, the same distribution and "
        "more tokens accepted at high temperatures (docs/performance.md), but another text "
        "than without a draft.", metavar="exact|rejection",
        envvar="SPECLI_SPEC_SAMPLING", rich_help_panel=DRAFTING)] = config.DraftPolicy.sampling,
    **knobs: Any,
) -> Drafting:
    """The drafting flags, checked: draft lengths (config.DRAFTING's flags, in `knobs`),
    then n-gram settings, then types."""
    names = [t.strip() for t in (spec_type or "").split(",")]
    if "draft-translate" in names:  # the draft model, through text
        draft_translate = True
        spec_type = ",".join(dict.fromkeys("draft-simple" if t == "draft-translate" else t
                                           for t in names))
    params = draft_params(translate=draft_translate, sampling=spec_sampling.strip().lower(),
                          **knobs)
    ngram = ngram_params(
        size_n=ngram_size_n, size_m=ngram_size_m, min_hits=ngram_min_hits,
        simple_n=simple_size_n, simple_m=simple_size_m, simple_hits=simple_min_hits,
        map_k_n=map_k_size_n, map_k_m=map_k_size_m, map_k_hits=map_k_min_hits,
        k4v_n=map_k4v_size_n, k4v_m=map_k4v_size_m, k4v_hits=map_k4v_min_hits,
        mod_match=ngram_mod_n_match, mod_max=ngram_mod_n_max, mod_min=ngram_mod_n_min,
        lookup_static=lookup_cache_static, lookup_dynamic=lookup_cache_dynamic)
    types = spec_types(spec_type, lookup_cache_static, lookup_cache_dynamic)
    return Drafting(tuple(types), params, ngram)


def _knob(knob: config.DraftKnob) -> inspect.Parameter:
    """A DRAFTING knob's flag as a Typer parameter, named by its field; --draft (a metavar
    of its own) takes K or auto, as text."""
    default = knob.default()
    kind, default = (str | None, None) if knob.metavar else (knob.kind, default)
    return inspect.Parameter(knob.field, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                             default=default,
                             annotation=Annotated[kind, typer.Option(
                                 *knob.flags, help=knob.help, envvar=list(knob.envvars),
                                 metavar=knob.metavar, rich_help_panel=DRAFTING,
                                 show_default=knob.metavar is None)])


_own = inspect.signature(_drafting_flags, eval_str=True)
_drafting_flags.__signature__ = _own.replace(parameters=[  # type: ignore[attr-defined]
    *(p for p in _own.parameters.values() if p.kind is not p.VAR_KEYWORD),
    *map(_knob, config.DRAFTING)])

DRAFTING_FLAGS = Group(_drafting_flags)


def parse_draft(value: str) -> tuple[int, bool]:
    """--draft K or --draft auto -> (k or the auto cap, adaptive); its range is the
    policy's to check."""
    if value.strip().lower() == "auto":
        return config.DRAFT_AUTO_MAX, True
    try:
        return int(value), False
    except ValueError:
        raise UsageError(f"--draft must be a whole number or auto, got {value!r}") from None


def ngram_params(*, size_n: int | None, size_m: int | None, min_hits: int | None,
                 simple_n: int | None, simple_m: int | None, simple_hits: int | None,
                 map_k_n: int | None, map_k_m: int | None, map_k_hits: int | None,
                 k4v_n: int | None, k4v_m: int | None, k4v_hits: int | None, mod_match: int,
                 mod_max: int, mod_min: int, lookup_static: str | None,
                 lookup_dynamic: str | None) -> config.NgramParams:
    """Resolve the seed-era shared flags and llama.cpp's per-type ones (the latter win)."""
    d = config.NgramParams()
    if simple_hits is not None and simple_hits < 1:  # ngram-simple uses no more than 1
        raise UsageError(f"--spec-ngram-simple-min-hits must be at least 1, got {simple_hits}")
    for flag, v in (("--spec-ngram-size-n", size_n), ("--spec-ngram-size-m", size_m),
                    ("--spec-ngram-min-hits", min_hits), ("--spec-ngram-simple-size-n", simple_n),
                    ("--spec-ngram-simple-size-m", simple_m),
                    ("--spec-ngram-map-k-size-n", map_k_n), ("--spec-ngram-map-k-size-m", map_k_m),
                    ("--spec-ngram-map-k-min-hits", map_k_hits),
                    ("--spec-ngram-map-k4v-size-n", k4v_n),
                    ("--spec-ngram-map-k4v-size-m", k4v_m),
                    ("--spec-ngram-map-k4v-min-hits", k4v_hits),
                    ("--spec-ngram-mod-n-match", mod_match), ("--spec-ngram-mod-n-max", mod_max)):
        if v is not None and not 1 <= v <= 1024:
            raise UsageError(f"{flag} must be between 1 and 1024, got {v}")
    if not 0 <= mod_min <= mod_max:
        raise UsageError(f"--spec-ngram-mod-n-min must be between 0 and --spec-ngram-mod-n-max "
                         f"({mod_max}), got {mod_min}")

    def pick(*values: int | None) -> int:
        return next(v for v in values if v is not None)

    return config.NgramParams(
        size_n=pick(simple_n, size_n, d.size_n), size_m=pick(simple_m, size_m, d.size_m),
        map_k_size_n=pick(map_k_n, size_n, d.map_k_size_n),
        map_k_size_m=pick(map_k_m, size_m, d.map_k_size_m),
        map_k_min_hits=pick(map_k_hits, min_hits, d.map_k_min_hits),
        map_k4v_size_n=pick(k4v_n, size_n, d.map_k4v_size_n),
        map_k4v_size_m=pick(k4v_m, size_m, d.map_k4v_size_m),
        map_k4v_min_hits=pick(k4v_hits, min_hits, d.map_k4v_min_hits),
        mod_n_match=mod_match, mod_n_max=mod_max, mod_n_min=mod_min,
        lookup_static=lookup_static, lookup_dynamic=lookup_dynamic)


def spec_types(value: str | None, lookup_static: str | None = None,
               lookup_dynamic: str | None = None) -> list[str]:
    """--spec-type's list; -lcs/-lcd alone mean ngram-cache, and need it in a given list."""
    if value is None:
        return ["ngram-cache"] if lookup_static or lookup_dynamic else []
    try:
        types = list(config.parse_spec_types(value))
    except ValueError as e:
        raise UsageError(f"unknown --spec-type {e}",
                         hint="one or more of: " + ", ".join(config.SPEC_TYPES)) from None
    if (lookup_static or lookup_dynamic) and "ngram-cache" not in types:
        raise UsageError("-lcs/-lcd are lookup caches for --spec-type ngram-cache",
                         hint="add ngram-cache to --spec-type")
    return types


def draft_params(n_max: str | None = None, translate: bool = False,
                 **values: Any) -> config.DraftPolicy:
    """--draft (K or auto) and the other DRAFTING flags (by field) as the policy, which
    checks them. An explicit K also caps the n-gram types' own lengths."""
    k, adaptive = parse_draft(n_max if n_max is not None else str(config.DEFAULT_DRAFT_MAX))
    try:
        return config.DraftPolicy(n_max=k, adaptive=adaptive,
                                  cap_ngram=n_max is not None and not adaptive,
                                  translate=translate, **values)
    except config.PlanError as e:
        raise refused(e) from None


def with_n_seq(drafting: Drafting, n_seq: int, flag: str) -> Drafting:
    """The drafting flags with another number of draft sequences (run's -np), checked."""
    try:
        return replace(drafting, params=replace(drafting.params, n_seq=n_seq))
    except config.PlanError as e:
        raise refused(e, n_seq=flag) from None
