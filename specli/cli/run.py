"""`specli run`: generate with a draft model, print llama.cpp-style statistics."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from specli.cli import options as o
from specli.cli.console import err, spinner
from specli.errors import SpecliError, UsageError

DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."


@o.gpu_flags
def run(
    model: o.Model = None,
    model_draft: o.ModelDraft = None,
    hf_repo: o.HfRepo = None,
    hf_file: o.HfFile = None,
    hf_repo_draft: o.HfRepoDraft = None,
    hf_file_draft: o.HfFileDraft = None,
    hf_token: o.HfToken = None,
    prompt: Annotated[str | None, typer.Option(
        "-p", "--prompt", help="Prompt text. Default: a built-in chat prompt.",
        rich_help_panel="Input", show_default=False)] = None,
    file: Annotated[Path | None, typer.Option(
        "-f", "--file", help="Read the prompt from a file (one trailing newline is dropped).",
        rich_help_panel="Input", show_default=False)] = None,
    chat: Annotated[bool, typer.Option(
        "--chat", help="Wrap the prompt in the target's chat template (sandboxed).",
        rich_help_panel="Input")] = False,
    n_predict: Annotated[int, typer.Option(
        "-n", "--n-predict", "--predict", help="Tokens to generate; -1 until end of generation "
        "or full context.", envvar="LLAMA_ARG_N_PREDICT",
        rich_help_panel="Input")] = o.DEFAULTS["n_predict"],
    spec_type: o.SpecTypeOpt = None,
    ngram_size_n: o.NgramSizeN = None,
    ngram_size_m: o.NgramSizeM = None,
    ngram_min_hits: o.NgramMinHits = None,
    simple_size_n: o.SimpleSizeN = None,
    simple_size_m: o.SimpleSizeM = None,
    simple_min_hits: o.SimpleMinHits = None,
    map_k_size_n: o.MapKSizeN = None,
    map_k_size_m: o.MapKSizeM = None,
    map_k_min_hits: o.MapKMinHits = None,
    map_k4v_size_n: o.MapK4vSizeN = None,
    map_k4v_size_m: o.MapK4vSizeM = None,
    map_k4v_min_hits: o.MapK4vMinHits = None,
    ngram_mod_n_match: o.NgramModMatch = 24,
    ngram_mod_n_max: o.NgramModMax = 64,
    ngram_mod_n_min: o.NgramModMin = 48,
    lookup_cache_static: o.LookupStatic = None,
    lookup_cache_dynamic: o.LookupDynamic = None,
    draft: o.DraftMax = None,
    draft_min: o.DraftMin = 0,
    draft_p_min: o.DraftPMin = 0.0,
    no_spec: o.NoSpec = False,
    baseline: Annotated[bool, typer.Option(
        "--baseline", help="Also decode with the target alone in this process; print the "
        "speedup.", rich_help_panel=o.OUTPUT)] = False,
    temp: o.Temp = 0.8,
    top_k: o.TopK = 40,
    top_p: o.TopP = 0.95,
    min_p: o.MinP = 0.05,
    seed: o.Seed = -1,
    ctx_size: o.CtxSize = o.DEFAULTS["ctx"],
    ctx_size_draft: o.CtxSizeDraft = None,
    n_gpu_layers: o.GpuLayers = 0,
    n_gpu_layers_draft: o.GpuLayersDraft = 0,
    threads: o.Threads = o.DEFAULTS["threads"],
    threads_draft: o.ThreadsDraft = None,
    threads_batch: o.ThreadsBatch = None,
    threads_batch_draft: o.ThreadsBatchDraft = None,
    cache_type_k: o.CacheTypeK = None,
    cache_type_v: o.CacheTypeV = None,
    cache_type_k_draft: o.CacheTypeKDraft = None,
    cache_type_v_draft: o.CacheTypeVDraft = None,
    flash_attn: o.FlashAttnOpt = o.FlashAttn.auto,
    json_out: o.Json = False,
    verbose: o.Verbose = False,
    gpu: o.GpuFlags | None = None,
) -> None:
    """Generate text with speculative decoding: a draft model proposes, the target verifies.

    The text streams to stdout; llama.cpp-style statistics go to stderr (or, with --json, one
    JSON object goes to stdout). With no -m, the embedded SmolLM2 pair is used.
    """
    dp = o.draft_params(draft, draft_min, draft_p_min)
    sampling = o.sampling(temp, top_k, top_p, min_p, seed)
    o.check_ranges(n_predict, ctx_size, threads)
    ngram = o.ngram_params(ngram_size_n, ngram_size_m, ngram_min_hits, simple_size_n,
                           simple_size_m, simple_min_hits, map_k_size_n, map_k_size_m,
                           map_k_min_hits, map_k4v_size_n, map_k4v_size_m, map_k4v_min_hits,
                           ngram_mod_n_match, ngram_mod_n_max, ngram_mod_n_min,
                           lookup_cache_static, lookup_cache_dynamic)
    types = o.spec_types(spec_type, lookup_cache_static, lookup_cache_dynamic)
    text, chat = _prompt(prompt, file, chat)

    from specli.cli.download import resolve_models

    model, model_draft = resolve_models(model, model_draft, hf_repo, hf_file, hf_repo_draft,
                                        hf_file_draft, hf_token, quiet=json_out)
    if "draft-simple" in types and model_draft is None:
        raise UsageError("--spec-type draft-simple needs a draft model", hint="add -md FILE")
    if no_spec:
        model_draft, types = None, []

    target_params, draft_params = o.model_params(
        model, model_draft, ctx=ctx_size, ctx_draft=ctx_size_draft, ngl=n_gpu_layers,
        ngld=n_gpu_layers_draft, threads=threads, threads_draft=threads_draft,
        threads_batch=threads_batch, threads_batch_draft=threads_batch_draft, ctk=cache_type_k,
        ctv=cache_type_v, ctkd=cache_type_k_draft, ctvd=cache_type_v_draft,
        flash_attn=flash_attn, verbose=verbose, gpu=gpu)

    from specli.engine import Engine

    with spinner("loading models", json_out):
        engine = Engine.load(target_params, draft_params, dp, spec_types=types, ngram=ngram)
    try:
        if engine.draft is None and not no_spec and not json_out:
            err.print("note: no draft model (-md) or n-gram type (--spec-type): decoding with "
                      "the target alone", markup=False)
        if chat and engine.target.chat_template() is None and not json_out:
            err.print("note: the target has no chat template; using ChatML", markup=False)
        ids = engine.tokenize(text, chat=chat)
        pieces: list[str] = []
        stats = None
        for chunk in engine.stream(ids, n_predict, sampling):
            pieces.append(chunk.text)
            if not json_out and chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            stats = chunk.stats or stats
        out_text = "".join(pieces)
        baseline_match = None
        if baseline:
            with spinner("measuring the baseline (target alone)", json_out):
                plain = engine.complete(ids, n_predict, replace(sampling, seed=stats.seed),
                                        speculative=False)
            stats.baseline_decode_tps = plain.stats.decode_tps
            baseline_match = plain.text == out_text if sampling.greedy else None
    except BrokenPipeError:
        raise _reader_gone() from None
    finally:
        engine.close()

    try:
        _report(out_text, stats, baseline_match, json_out, model, model_draft)
    except BrokenPipeError:
        raise _reader_gone() from None


def _reader_gone() -> typer.Exit:
    """The reader of stdout went away (specli run | head): end quietly, as SIGPIPE would."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return typer.Exit(141)


def _report(out_text: str, stats, baseline_match: bool | None, json_out: bool, model: str,
            model_draft: str | None) -> None:
    from specli.stats import format_llama

    if json_out:
        doc = {"text": out_text, "model": model, "model_draft": model_draft,
               "baseline_identical": baseline_match, "stats": stats.to_dict()}
        sys.stdout.write(json.dumps(doc) + "\n")
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    sys.stderr.write("\n" + format_llama(stats))
    if baseline_match is not None:
        sys.stderr.write(f"baseline output identical = {'yes' if baseline_match else 'no'}\n")


def _prompt(prompt: str | None, file: Path | None, chat: bool) -> tuple[str, bool]:
    if prompt is not None and file is not None:
        raise UsageError("give -p/--prompt or -f/--file, not both")
    if file is not None:
        try:
            text = file.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise SpecliError(f"prompt file not found: {file}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise SpecliError(f"cannot read prompt file {file}: {e}") from None
        text = text[:-1] if text.endswith("\n") else text  # as llama.cpp's -f does
        if not text.strip():
            raise UsageError(f"prompt file is empty: {file}")
        return text, chat
    if prompt is None:
        return DEFAULT_PROMPT, True
    if not prompt:
        raise UsageError("empty prompt", hint="give -p TEXT or -f FILE")
    return prompt, chat
