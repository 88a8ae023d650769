"""The commands' flags, with llama.cpp's spellings (older and current), in groups.

Each group is declared once, as a function whose Annotated parameters are its flags and whose
result is one frozen config object (llama.cpp parses one common_params the same way). A command
names the groups it takes as parameters whose default is the group; `@grouped` splices the
group's flags into the command's signature in their place (Typer reads __signature__) and
hands the command the parsed object.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from specli import config, rpc
from specli.cli.console import err
from specli.errors import UsageError

if TYPE_CHECKING:
    from specli.plan import SpecPlan

MODELS = "Models"
DRAFTING = "Drafting"
SAMPLING = "Sampling"
RESOURCES = "Context and threads"
OUTPUT = "Output"
NGRAM = "n-gram drafting"
GPU = "GPU placement"


class FlashAttn(StrEnum):
    on = "on"
    off = "off"
    auto = "auto"


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


# -- one-flag declarations shared by several commands ---------------------------------------

Json = Annotated[bool, typer.Option(
    "--json", help="Print one JSON object on stdout: text and every statistic.",
    rich_help_panel=OUTPUT)]
Verbose = Annotated[bool, typer.Option(
    "-v", "--verbose", help="Show llama.cpp's own log on stderr.", rich_help_panel=OUTPUT)]
NoSpec = Annotated[bool, typer.Option(
    "--no-spec", help="Decode with the target alone.", rich_help_panel=DRAFTING)]


# -- models: -m/-md, or -hf/-hfd through the hub ----------------------------------------------

@dataclass(frozen=True)
class ModelFiles:
    """-m/-md or -hf/-hff/-hfd/-hffd (and -hft), as given."""

    model: str | None = None
    model_draft: str | None = None
    hf_repo: str | None = None
    hf_file: str | None = None
    hf_repo_draft: str | None = None
    hf_file_draft: str | None = None
    hf_token: str | None = None

    def resolve(self, quiet: bool = False,
                spec_types: Sequence[str] = ()) -> tuple[str, str | None]:
        """The target's and the draft's paths: downloaded through the hub for -hf/-hfd (a
        draft-head sidecar first, see resolve_models), the embedded SmolLM2 pair when neither
        -m nor -hf is given."""
        from specli.cli.models import resolve_models

        return resolve_models(self.model, self.model_draft, self.hf_repo, self.hf_file,
                              self.hf_repo_draft, self.hf_file_draft, self.hf_token,
                              quiet=quiet, spec_types=spec_types)


def _model_opt(*names: str, help: str, envvar: str | list[str] | None = None):
    return typer.Option(*names, help=help, envvar=envvar, rich_help_panel=MODELS,
                        show_default=False)


def _model_flags(
    model: Annotated[str | None, _model_opt(
        "-m", "--model", envvar="LLAMA_ARG_MODEL",
        help="Target GGUF model. Default: the embedded SmolLM2 pair.")] = None,
    model_draft: Annotated[str | None, _model_opt(
        "-md", "--model-draft", "--spec-draft-model",
        envvar=["LLAMA_ARG_SPEC_DRAFT_MODEL", "LLAMA_ARG_MODEL_DRAFT"],
        help="Draft GGUF model (same tokenizer as the target).")] = None,
    hf_repo: Annotated[str | None, _model_opt(
        "-hf", "-hfr", "--hf-repo", envvar="LLAMA_ARG_HF_REPO",
        help="Target from Hugging Face: owner/name[:QUANT] (like llama.cpp's -hf; Q4_K_M, "
        "then Q8_0, when no quant is given).")] = None,
    hf_file: Annotated[str | None, _model_opt(
        "-hff", "--hf-file", envvar="LLAMA_ARG_HF_FILE",
        help="The target's file in the -hf repository, instead of a quant.")] = None,
    hf_repo_draft: Annotated[str | None, _model_opt(
        "-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf",
        envvar="LLAMA_ARG_SPEC_DRAFT_HF_REPO",
        help="Draft from Hugging Face: owner/name[:QUANT].")] = None,
    hf_file_draft: Annotated[str | None, _model_opt(
        "-hffd", "--hf-file-draft",
        help="The draft's file in the -hfd repository.")] = None,
    hf_token: Annotated[str | None, _model_opt(
        "-hft", "--hf-token", envvar="HF_TOKEN",
        help="Hugging Face token (default: the saved login).")] = None,
) -> ModelFiles:
    return ModelFiles(model, model_draft, hf_repo, hf_file, hf_repo_draft, hf_file_draft,
                      hf_token)


MODEL_FILES = Group(_model_flags)


# -- drafting: what drafts and how much -------------------------------------------------------

@dataclass(frozen=True)
class Drafting:
    """--spec-type's list, the draft lengths (--draft, --draft-min, --draft-p-min) and the
    n-gram settings."""

    types: tuple[str, ...] = ()
    params: config.DraftPolicy = config.DraftPolicy()
    ngram: config.NgramParams = config.NgramParams()


# what a flag says about each of a plan's fields (plan.PlanError.field)
PLAN_HINTS = {"types": "check --spec-type", "draft": "add -md FILE",
              "n_seq": f"-np/--draft-n-seq takes 1 to {config.MAX_DRAFT_SEQ}",
              "p_split": "--draft-p-split takes 0 to 1", "n_max": "give --draft N, not auto",
              "slots": "fewer -np slots or a smaller --draft-n-seq"}


def plan(drafting: Drafting, model_draft: str | None) -> SpecPlan:
    """The drafting flags as one plan, checked before any model loads; its errors name the
    flags."""
    from specli.plan import PlanError, SpecPlan, draft_head

    try:
        return SpecPlan.resolve(drafting.types, model_draft is not None, drafting.params,
                                drafting.ngram, draft_head(model_draft))
    except PlanError as e:
        raise UsageError(e.message, hint=PLAN_HINTS[e.field]) from None


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
    draft: Annotated[str | None, typer.Option(
        "--draft", "--draft-max", "--draft-n", "--spec-draft-n-max", metavar="K|auto",
        help="Most tokens drafted per step (k). Default: 8 for the draft model and "
        "ngram-cache, while the other n-gram types draft up to their own m, as in llama.cpp; "
        "given explicitly, K caps them too. `auto`: k chosen each step, per source, from the "
        f"measured acceptance and cost (up to {config.DRAFT_AUTO_MAX}, 0 included: the "
        "target alone); on serve, for the whole batch of slots, and serve's default.",
        envvar=["LLAMA_ARG_SPEC_DRAFT_N_MAX", "LLAMA_ARG_DRAFT_MAX"],
        rich_help_panel=DRAFTING, show_default=False)] = None,
    draft_min: Annotated[int, typer.Option(
        "--draft-min", "--spec-draft-n-min", "--draft-n-min",
        help="A draft shorter than this is not verified.",
        envvar=["LLAMA_ARG_SPEC_DRAFT_N_MIN", "LLAMA_ARG_DRAFT_MIN"],
        rich_help_panel=DRAFTING)] = config.DraftPolicy.n_min,
    draft_p_min: Annotated[float, typer.Option(
        "--draft-p-min", "--spec-draft-p-min",
        help="Stop drafting when the draft's top probability falls below this.",
        envvar=["LLAMA_ARG_SPEC_DRAFT_P_MIN", "LLAMA_ARG_DRAFT_P_MIN"],
        rich_help_panel=DRAFTING)] = config.DraftPolicy.p_min,
    draft_n_seq: Annotated[int, typer.Option(
        "--draft-n-seq", "--spec-draft-n-seq",
        help="Draft sequences: more than 1 drafts a tree, as llama-speculative's -np, a "
        "branch splitting where the draft's next candidate is above --draft-p-split; the "
        "target verifies every node in one batch. Needs a draft model alone (no n-gram "
        "types) and a fixed --draft, which caps the tree's nodes.",
        envvar="LLAMA_ARG_SPEC_DRAFT_N_SEQ",
        rich_help_panel=DRAFTING)] = config.DraftPolicy.n_seq,
    draft_translate: Annotated[bool, typer.Option(
        "--draft-translate", help="The draft model (-md) has another tokenizer: its drafts "
        "are turned into text and the text into the target's tokens, which the target "
        "verifies (a pair llama.cpp refuses; it accepts less than a same-family draft).",
        rich_help_panel=DRAFTING)] = False,
    draft_p_split: Annotated[float, typer.Option(
        "--draft-p-split", "--spec-draft-p-split",
        help="A draft tree branches where the draft's next candidate is more likely than "
        "this (with --draft-n-seq or run's -np above 1).",
        envvar="LLAMA_ARG_SPEC_DRAFT_P_SPLIT",
        rich_help_panel=DRAFTING)] = config.DraftPolicy.p_split,
) -> Drafting:
    """The drafting flags, checked: draft lengths, then n-gram settings, then types."""
    names = [t.strip() for t in (spec_type or "").split(",")]
    if "draft-translate" in names:  # the draft model, through text
        draft_translate = True
        spec_type = ",".join(dict.fromkeys("draft-simple" if t == "draft-translate" else t
                                           for t in names))
    params = replace(draft_params(draft, draft_min, draft_p_min, draft_n_seq, draft_p_split),
                     translate=draft_translate)
    ngram = ngram_params(
        size_n=ngram_size_n, size_m=ngram_size_m, min_hits=ngram_min_hits,
        simple_n=simple_size_n, simple_m=simple_size_m, simple_hits=simple_min_hits,
        map_k_n=map_k_size_n, map_k_m=map_k_size_m, map_k_hits=map_k_min_hits,
        k4v_n=map_k4v_size_n, k4v_m=map_k4v_size_m, k4v_hits=map_k4v_min_hits,
        mod_match=ngram_mod_n_match, mod_max=ngram_mod_n_max, mod_min=ngram_mod_n_min,
        lookup_static=lookup_cache_static, lookup_dynamic=lookup_cache_dynamic)
    types = spec_types(spec_type, lookup_cache_static, lookup_cache_dynamic)
    return Drafting(tuple(types), params, ngram)


DRAFTING_FLAGS = Group(_drafting_flags)


# -- sampling -----------------------------------------------------------------------------------

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


# -- resources: contexts, threads, KV cache, offloaded layers ----------------------------------

@dataclass(frozen=True)
class Resources:
    """The context, thread, KV-cache and layer flags of the target and the draft; a draft
    value left out takes the target's, as in llama.cpp."""

    ctx: int = config.DEFAULT_CTX
    ctx_draft: int | None = None
    ngl: int = 0
    ngld: int = 0
    threads: int = config.DEFAULT_THREADS
    threads_draft: int | None = None
    threads_batch: int | None = None
    threads_batch_draft: int | None = None
    ctk: str | None = None
    ctv: str | None = None
    ctkd: str | None = None
    ctvd: str | None = None
    flash_attn: str = "auto"
    batch: int = 2048
    ubatch: int = 512
    mmap: bool = True
    mlock: bool = False
    warmup: bool = True

    def model_params(self, model: str, model_draft: str | None, *, verbose: bool = False,
                     gpu: GpuFlags | None = None,
                     ) -> tuple[config.ModelParams, config.ModelParams | None]:
        """The target's and the draft's ModelParams."""
        gpu = gpu or GpuFlags()
        if (self.ngl or self.ngld) and not gpu.rpc:  # llama.cpp warns at its -ngl
            from specli.backend import local_gpu

            if not local_gpu():
                for flag, n in (("-ngl", self.ngl), ("-ngld", self.ngld)):
                    if n:
                        err.print(f"warning: no usable GPU found, {flag} {n} is ignored "
                                  "(this llama-cpp-python build, or this machine, has none)",
                                  markup=False, soft_wrap=True)
        if gpu.rpc and self.ngl == 0:
            err.print("warning: --rpc with -ngl 0 offloads no layer: the RPC servers hold "
                      "nothing (-ngl 99 puts every layer there)", markup=False, soft_wrap=True)
        target = config.ModelParams(
            path=model, n_ctx=self.ctx, n_gpu_layers=self.ngl, n_threads=self.threads,
            n_threads_batch=self.threads_batch, type_k=self.ctk, type_v=self.ctv,
            flash_attn=self.flash_attn, verbose=verbose, n_batch=self.batch,
            n_ubatch=self.ubatch, use_mmap=self.mmap, use_mlock=self.mlock,
            warmup=self.warmup)
        if model_draft is None:
            return gpu.apply(target, None)
        td = self.threads_draft or self.threads
        return gpu.apply(target, config.ModelParams(
            path=model_draft, n_ctx=self.ctx_draft or self.ctx, n_gpu_layers=self.ngld,
            n_threads=td, n_threads_batch=self.threads_batch_draft or td, type_k=self.ctkd,
            type_v=self.ctvd, flash_attn=self.flash_attn, verbose=verbose,
            use_mmap=self.mmap, use_mlock=self.mlock, warmup=self.warmup))


def _res_opt(*names: str, help: str, envvar: str | None = None, **kw):
    return typer.Option(*names, help=help, envvar=envvar, rich_help_panel=RESOURCES, **kw)


def _resource_flags(
    ctx_size: Annotated[int, _res_opt(
        "-c", "--ctx-size", help="Target context size.",
        envvar="LLAMA_ARG_CTX_SIZE")] = config.DEFAULT_CTX,
    ctx_size_draft: Annotated[int | None, _res_opt(
        "-cd", "--ctx-size-draft", help="Draft context size. Default: same as -c.",
        show_default=False)] = None,
    n_gpu_layers: Annotated[str, _res_opt(
        "-ngl", "--n-gpu-layers", "--gpu-layers", metavar="N|auto|all",
        help="Target layers to offload to the GPU: a number, all, or auto (all of them where "
        "this machine has a GPU, else none; llama.cpp's auto also fits them to its free "
        "memory).", envvar="LLAMA_ARG_N_GPU_LAYERS")] = "0",
    n_gpu_layers_draft: Annotated[str, _res_opt(
        "-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft", "--spec-draft-ngl",
        metavar="N|auto|all", help="Draft layers to offload to the GPU (as -ngl).",
        envvar="LLAMA_ARG_N_GPU_LAYERS_DRAFT")] = "0",
    threads: Annotated[int, _res_opt(
        "-t", "--threads", help="Threads for generation. Default: the CPU count, at most 8.",
        envvar="LLAMA_ARG_THREADS", show_default=False)] = config.DEFAULT_THREADS,
    threads_draft: Annotated[int | None, _res_opt(
        "-td", "--threads-draft", help="Draft threads. Default: same as -t.",
        show_default=False)] = None,
    threads_batch: Annotated[int | None, _res_opt(
        "-tb", "--threads-batch", help="Threads for batches and prompts. Default: same as -t.",
        show_default=False)] = None,
    threads_batch_draft: Annotated[int | None, _res_opt(
        "-tbd", "--threads-batch-draft", help="Draft batch threads. Default: same as -td.",
        show_default=False)] = None,
    cache_type_k: Annotated[str | None, _res_opt(
        "-ctk", "--cache-type-k", help="Target KV cache type for K (f16, q8_0, q4_0, ...).",
        envvar="LLAMA_ARG_CACHE_TYPE_K", show_default=False)] = None,
    cache_type_v: Annotated[str | None, _res_opt(
        "-ctv", "--cache-type-v", help="Target KV cache type for V.",
        envvar="LLAMA_ARG_CACHE_TYPE_V", show_default=False)] = None,
    cache_type_k_draft: Annotated[str | None, _res_opt(
        "-ctkd", "--cache-type-k-draft", "--spec-draft-type-k",
        help="Draft KV cache type for K.", envvar="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K",
        show_default=False)] = None,
    cache_type_v_draft: Annotated[str | None, _res_opt(
        "-ctvd", "--cache-type-v-draft", "--spec-draft-type-v",
        help="Draft KV cache type for V.", envvar="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V",
        show_default=False)] = None,
    flash_attn: Annotated[FlashAttn, _res_opt(
        "-fa", "--flash-attn", help="Flash attention (llama.cpp's default: auto).",
        envvar="LLAMA_ARG_FLASH_ATTN")] = FlashAttn.auto,
    batch_size: Annotated[int, _res_opt(
        "-b", "--batch-size", help="Logical batch size: the most tokens one decode takes.",
        envvar="LLAMA_ARG_BATCH")] = 2048,
    ubatch_size: Annotated[int, _res_opt(
        "-ub", "--ubatch-size", help="Physical batch size.",
        envvar="LLAMA_ARG_UBATCH")] = 512,
    mmap: Annotated[bool, _res_opt(
        "--mmap/--no-mmap", help="Map the model files into memory (the default), or read "
        "them in (--no-mmap: slower to load, and no page cache shared between processes).",
        envvar="LLAMA_ARG_MMAP")] = True,
    mlock: Annotated[bool, _res_opt(
        "--mlock", help="Keep the weights in RAM: the system may not swap them out.",
        envvar="LLAMA_ARG_MLOCK")] = False,
    warmup: Annotated[bool, _res_opt(
        "--warmup/--no-warmup", help="Decode once at load (llama.cpp's warmup: the weights "
        "paged in and the graph allocated before the first prompt is timed), or not.")
    ] = True,
) -> Resources:
    if ctx_size < 16:
        raise UsageError(f"-c/--ctx-size must be at least 16, got {ctx_size}")
    if threads < 1:
        raise UsageError(f"-t/--threads must be at least 1, got {threads}")
    if batch_size < 2 or ubatch_size < 1:  # a verification needs room for a drafted token
        raise UsageError(f"-b/--batch-size must be at least 2 and -ub/--ubatch-size at least "
                         f"1, got {batch_size} and {ubatch_size}")
    return Resources(ctx_size, ctx_size_draft, parse_ngl(n_gpu_layers, "-ngl"),
                     parse_ngl(n_gpu_layers_draft, "-ngld"), threads,
                     threads_draft, threads_batch, threads_batch_draft, cache_type_k,
                     cache_type_v, cache_type_k_draft, cache_type_v_draft,
                     FlashAttn(flash_attn).value, batch_size, ubatch_size, mmap, mlock,
                     warmup)


RESOURCE_FLAGS = Group(_resource_flags)


# -- checks -----------------------------------------------------------------------------------

ALL_LAYERS = 999  # more layers than any model has: every one of them


def parse_ngl(value: str, flag: str) -> int:
    """-ngl N|auto|all as llama.cpp takes it: all is every layer, auto every layer where
    this machine has a GPU and none where it has not."""
    v = value.strip().lower()
    if v == "all":
        return ALL_LAYERS
    if v == "auto":
        from specli.backend import local_gpu

        return ALL_LAYERS if local_gpu() else 0
    try:
        return int(v)
    except ValueError:
        raise UsageError(f"{flag} takes a number of layers, auto or all, got {value!r}") \
            from None


def parse_draft(value: str) -> tuple[int, bool]:
    """--draft K or --draft auto -> (k or the auto cap, adaptive)."""
    if value.strip().lower() == "auto":
        return config.DRAFT_AUTO_MAX, True
    try:
        k = int(value)
    except ValueError:
        raise UsageError(f"--draft must be a whole number or auto, got {value!r}") from None
    if k < 1:
        raise UsageError(f"--draft must be at least 1 (got {k})",
                         hint="use --no-spec to decode without a draft")
    return k, False


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


def draft_params(draft: str | None, draft_min: int, p_min: float, n_seq: int = 1,
                 p_split: float = config.DraftPolicy.p_split) -> config.DraftPolicy:
    """--draft (K or auto), --draft-min, --draft-p-min, --draft-n-seq and --draft-p-split,
    checked. An explicit K also caps the n-gram types' own lengths."""
    k, adaptive = parse_draft(draft if draft is not None else str(config.DEFAULT_DRAFT_MAX))
    if draft_min < 0 or draft_min > k:
        raise UsageError(f"--draft-min must be between 0 and --draft ({k}), got {draft_min}")
    if not 0.0 <= p_min <= 1.0:
        raise UsageError(f"--draft-p-min must be between 0 and 1, got {p_min}")
    if not 1 <= n_seq <= config.MAX_DRAFT_SEQ:
        raise UsageError(f"--draft-n-seq must be between 1 and {config.MAX_DRAFT_SEQ}, got {n_seq}")
    if not 0.0 <= p_split <= 1.0:
        raise UsageError(f"--draft-p-split must be between 0 and 1, got {p_split}")
    if n_seq > 1 and adaptive:
        raise UsageError("a draft tree (--draft-n-seq above 1) takes a fixed --draft",
                         hint="give --draft N instead of auto")
    return config.DraftPolicy(n_max=k, n_min=draft_min, p_min=p_min, adaptive=adaptive,
                              cap_ngram=draft is not None and not adaptive, n_seq=n_seq,
                              p_split=p_split)


def with_n_seq(drafting: Drafting, n_seq: int, flag: str) -> Drafting:
    """The drafting flags with another number of draft sequences (run's -np), checked."""
    if not 1 <= n_seq <= config.MAX_DRAFT_SEQ:
        raise UsageError(f"{flag} must be between 1 and {config.MAX_DRAFT_SEQ}, got {n_seq}")
    if n_seq > 1 and drafting.params.adaptive:
        raise UsageError("a draft tree (-np above 1) takes a fixed --draft",
                         hint="give --draft N instead of auto")
    return replace(drafting, params=replace(drafting.params, n_seq=n_seq))


def check_n_predict(n_predict: int) -> None:
    """Before any model loads: -1 (unlimited) or a number of tokens; 0 would load and
    prefill to generate nothing."""
    if n_predict < -1:
        raise UsageError(f"-n/--n-predict must be -1 (unlimited) or more, got {n_predict}")
    if n_predict == 0:
        raise UsageError("-n 0 generates nothing", hint="give a number of tokens, or -1 until "
                         "the end of generation")


# -- GPU placement: one group of flags, spliced into each command that loads models ----------

# llama.cpp's -cmoe pattern (common.h LLM_FFN_EXPS_REGEX): every MoE expert tensor
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


@dataclass(frozen=True)
class GpuFlags:
    """Where the target's and the draft's layers go, parsed from llama.cpp's flags. devices:
    None for all, () for none; the draft follows the target's devices unless -devd names
    its own. overrides: (tensor regex, buffer type) in the order llama.cpp applies them."""

    devices: tuple[str, ...] | None = None
    devices_draft: tuple[str, ...] | None = None
    split_mode: str = "layer"
    tensor_split: tuple[float, ...] = ()
    main_gpu: int = 0
    overrides: tuple[tuple[str, str], ...] = ()
    overrides_draft: tuple[tuple[str, str], ...] = ()
    rpc: tuple[str, ...] = ()  # llama.cpp RPC servers whose devices join the offload devices

    def apply(self, target: config.ModelParams,
              draft: config.ModelParams | None) -> tuple[config.ModelParams,
                                                         config.ModelParams | None]:
        target = replace(target, devices=self.devices, split_mode=self.split_mode,
                         tensor_split=self.tensor_split, main_gpu=self.main_gpu,
                         tensor_overrides=self.overrides, rpc=self.rpc)
        if draft is None:
            return target, None
        devices = self.devices_draft if self.devices_draft is not None else self.devices
        # as llama.cpp: a draft pinned to one device of its own needs no split across devices
        split = "layer" if self.devices_draft and len(self.devices_draft) == 1 \
            else self.split_mode
        return target, replace(draft, devices=devices, split_mode=split,
                               tensor_split=self.tensor_split, main_gpu=self.main_gpu,
                               tensor_overrides=self.overrides_draft, rpc=self.rpc)


def placement_args(resources: Resources, gpu: GpuFlags) -> list[str]:
    """The flags that put the layers where they are (-ngl, --rpc, -dev, -ts...), to repeat
    in a command line that should run the same way (tune-draft's best command)."""
    def names(devs: tuple[str, ...]) -> str:
        return ",".join(devs) or "none"

    args = [*(["-ngl", str(resources.ngl)] if resources.ngl else []),
            *(["-ngld", str(resources.ngld)] if resources.ngld else []),
            *(["--rpc", ",".join(gpu.rpc)] if gpu.rpc else []),
            *(["-dev", names(gpu.devices)] if gpu.devices is not None else []),
            *(["-devd", names(gpu.devices_draft)] if gpu.devices_draft is not None else []),
            *(["-sm", gpu.split_mode] if gpu.split_mode != "layer" else []),
            *(["-ts", ",".join(f"{x:g}" for x in gpu.tensor_split)] if gpu.tensor_split
              else []),
            *(["-mg", str(gpu.main_gpu)] if gpu.main_gpu else [])]
    for flag, overrides in (("-ot", gpu.overrides), ("-otd", gpu.overrides_draft)):
        if overrides:
            args += [flag, ",".join(f"{p}={b}" for p, b in overrides)]
    return args


def _list_devices(ctx: typer.Context, value: bool) -> None:
    if not value:
        return
    from specli.backend import connect_rpc, list_devices

    connect_rpc(rpc.parse(ctx.params.get("rpc_servers")))  # --rpc given before: listed too

    print("Available devices:")
    for d in list_devices():
        print(f"  {d.name}: {d.description} ({d.type}, {d.memory_total >> 20} MiB, "
              f"{d.memory_free >> 20} MiB free)")
    raise typer.Exit()


def _gpu_opt(*names: str, help: str, envvar: str | None = None, **kw):
    return typer.Option(*names, help=help, envvar=envvar, rich_help_panel=GPU,
                        show_default=False, **kw)


def _gpu_flags(
    device: Annotated[str | None, _gpu_opt(
        "-dev", "--device", metavar="DEV1,DEV2", envvar="LLAMA_ARG_DEVICE",
        help="Devices to offload the target to, comma-separated (none: do not offload). "
        "Default: all; see --list-devices.")] = None,
    device_draft: Annotated[str | None, _gpu_opt(
        "-devd", "--device-draft", "--spec-draft-device", metavar="DEV1,DEV2",
        help="Devices for the draft model. Default: as -dev.")] = None,
    rpc_servers: Annotated[str | None, _gpu_opt(
        "--rpc", metavar="HOST:PORT,...", envvar="LLAMA_ARG_RPC",
        help="RPC servers (specli rpc-server, or llama.cpp's) whose devices join the offload "
        "devices as RPC0, RPC1, ...: -ngl layers are split across them (-ts), the rest stay "
        "here. The draft follows unless -devd says otherwise (-devd none: keep it "
        "local).", is_eager=True)] = None,
    list_devices: Annotated[bool, _gpu_opt(
        "--list-devices", help="Print the devices this build of llama.cpp can use and exit.",
        callback=_list_devices, is_eager=True)] = False,
    split_mode: Annotated[str, _gpu_opt(
        "-sm", "--split-mode", metavar="none|layer|row|tensor", envvar="LLAMA_ARG_SPLIT_MODE",
        help="How to split the model across GPUs: none (one GPU, -mg), layer, row, or tensor "
        "(experimental). Default: layer.")] = "layer",
    tensor_split: Annotated[str | None, _gpu_opt(
        "-ts", "--tensor-split", metavar="N0,N1,...", envvar="LLAMA_ARG_TENSOR_SPLIT",
        help="Proportion of the model for each GPU, e.g. 3,1.")] = None,
    main_gpu: Annotated[int, _gpu_opt(
        "-mg", "--main-gpu", metavar="INDEX", envvar="LLAMA_ARG_MAIN_GPU",
        help="The GPU for the whole model with -sm none, or for intermediate results and KV "
        "with -sm row. Default: 0.")] = 0,
    override_tensor: Annotated[list[str] | None, _gpu_opt(
        "-ot", "--override-tensor", metavar="PATTERN=BUFT,...",
        envvar="LLAMA_ARG_OVERRIDE_TENSOR",
        help="Keep the target's tensors whose names match a regex in a buffer type (CPU, "
        "CUDA0, ...).")] = None,
    override_tensor_draft: Annotated[list[str] | None, _gpu_opt(
        "-otd", "--override-tensor-draft", "--spec-draft-override-tensor",
        metavar="PATTERN=BUFT,...", help="The same for the draft model.")] = None,
    cpu_moe: Annotated[bool, _gpu_opt(
        "-cmoe", "--cpu-moe", envvar="LLAMA_ARG_CPU_MOE",
        help="Keep all of the target's Mixture-of-Experts weights on the CPU.")] = False,
    n_cpu_moe: Annotated[int, _gpu_opt(
        "-ncmoe", "--n-cpu-moe", metavar="N", envvar="LLAMA_ARG_N_CPU_MOE",
        help="Keep the MoE weights of the target's first N layers on the CPU.")] = 0,
    cpu_moe_draft: Annotated[bool, _gpu_opt(
        "-cmoed", "--cpu-moe-draft", "--spec-draft-cpu-moe",
        envvar="LLAMA_ARG_SPEC_DRAFT_CPU_MOE",
        help="Keep all of the draft's MoE weights on the CPU.")] = False,
    n_cpu_moe_draft: Annotated[int, _gpu_opt(
        "-ncmoed", "--n-cpu-moe-draft", "--spec-draft-n-cpu-moe", "--spec-draft-ncmoe",
        metavar="N", envvar="LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE",
        help="Keep the MoE weights of the draft's first N layers on the CPU.")] = 0,
) -> GpuFlags:
    """The GPU placement flags, checked; a device or buffer type that this build lacks is
    refused when the model loads, before any weights are read."""
    if split_mode not in ("none", "layer", "row", "tensor"):
        raise UsageError(f"-sm/--split-mode must be none, layer, row or tensor, got "
                         f"{split_mode!r}")
    for flag, n in (("-ncmoe/--n-cpu-moe", n_cpu_moe), ("-ncmoed/--n-cpu-moe-draft",
                                                          n_cpu_moe_draft)):
        if n < 0:
            raise UsageError(f"{flag} must be 0 or more, got {n}")
    return GpuFlags(
        devices=_devices(device, "-dev/--device"),
        devices_draft=_devices(device_draft, "-devd/--device-draft"),
        split_mode=split_mode, tensor_split=_tensor_split(tensor_split), main_gpu=main_gpu,
        overrides=_overrides(override_tensor, cpu_moe, n_cpu_moe, "-ot/--override-tensor"),
        overrides_draft=_overrides(override_tensor_draft, cpu_moe_draft, n_cpu_moe_draft,
                                   "-otd/--override-tensor-draft"),
        rpc=rpc.parse(rpc_servers))


def _devices(value: str | None, flag: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    names = [n.strip() for n in value.split(",")]
    if not value.strip() or any(not n for n in names):
        raise UsageError(f"{flag} takes device names, comma-separated, or none: {value!r}",
                         hint="see --list-devices")
    return () if names == ["none"] else tuple(names)


def _tensor_split(value: str | None) -> tuple[float, ...]:
    if value is None:
        return ()
    try:
        parts = tuple(float(v) for v in re.split(r"[,/]+", value.strip()))
    except ValueError:
        raise UsageError(f"-ts/--tensor-split takes proportions, comma-separated (3,1): "
                         f"{value!r}") from None
    if any(v < 0 or v != v or v == float("inf") for v in parts) or not any(parts):
        raise UsageError(f"-ts/--tensor-split proportions must be finite, 0 or more, and not "
                         f"all 0: {value!r}")
    return parts


def _overrides(values: list[str] | None, cpu_moe: bool, n_cpu_moe: int,
               flag: str) -> tuple[tuple[str, str], ...]:
    """-ot's PATTERN=BUFT pairs, then -cmoe's, then -ncmoe's (llama.cpp keeps the order of
    the command line; the first pattern that matches a tensor wins)."""
    out = []
    for item in (x for v in values or [] for x in v.split(",")):
        pattern, eq, buft = item.partition("=")
        if not eq or not pattern or not buft:
            raise UsageError(f"{flag} takes PATTERN=BUFFER_TYPE, comma-separated: {item!r}",
                             hint="e.g. -ot 'blk\\.[0-9]+\\.ffn_.*=CPU'")
        try:
            re.compile(pattern)
        except re.error as e:
            raise UsageError(f"{flag}: {pattern!r} is not a regular expression ({e})") from None
        out.append((pattern, buft))
    if cpu_moe:
        out.append((FFN_EXPS_REGEX, "CPU"))
    out += [(rf"blk\.{i}{FFN_EXPS_REGEX}", "CPU") for i in range(n_cpu_moe)]
    return tuple(out)


GPU_FLAGS = Group(_gpu_flags)
