"""Flag definitions shared by the commands, with llama.cpp's spellings (seed-era and current)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from specli import config

MODELS = "Models"
DRAFTING = "Drafting"
SAMPLING = "Sampling"
RESOURCES = "Context and threads"
OUTPUT = "Output"


class FlashAttn(StrEnum):
    on = "on"
    off = "off"
    auto = "auto"


Model = Annotated[str | None, typer.Option(
    "-m", "--model", help="Target GGUF model. Default: the embedded SmolLM2 pair.",
    rich_help_panel=MODELS, show_default=False)]
ModelDraft = Annotated[str | None, typer.Option(
    "-md", "--model-draft", help="Draft GGUF model (same tokenizer as the target).",
    rich_help_panel=MODELS, show_default=False)]
SpecTypeOpt = Annotated[str | None, typer.Option(
    "--spec-type", help="Speculation types, comma-separated (llama.cpp names): ngram-simple, "
    "ngram-mod, draft-simple. n-gram drafts take precedence in that order; the draft model "
    "(-md) fills in.",
    rich_help_panel=DRAFTING, show_default=False)]
NgramSizeN = Annotated[int, typer.Option(
    "--spec-ngram-size-n", "--spec-ngram-simple-size-n",
    help="n-gram size to look up in the history.", rich_help_panel=DRAFTING)]
NgramSizeM = Annotated[int, typer.Option(
    "--spec-ngram-size-m", "--spec-ngram-simple-size-m",
    help="Most tokens an n-gram match proposes (also capped by --draft).",
    rich_help_panel=DRAFTING)]
NgramModMatch = Annotated[int, typer.Option(
    "--spec-ngram-mod-n-match", help="ngram-mod lookup length.", rich_help_panel=DRAFTING)]
NgramModMax = Annotated[int, typer.Option(
    "--spec-ngram-mod-n-max", help="Most tokens ngram-mod drafts (also capped by --draft).",
    rich_help_panel=DRAFTING)]
NgramModMin = Annotated[int, typer.Option(
    "--spec-ngram-mod-n-min", help="ngram-mod drops a draft shorter than this.",
    rich_help_panel=DRAFTING)]
DraftMax = Annotated[int, typer.Option(
    "--draft", "--draft-max", "--spec-draft-n-max",
    help="Tokens to draft per step (k).", rich_help_panel=DRAFTING)]
DraftMin = Annotated[int, typer.Option(
    "--draft-min", "--spec-draft-n-min",
    help="A draft shorter than this is not verified.", rich_help_panel=DRAFTING)]
DraftPMin = Annotated[float, typer.Option(
    "--draft-p-min", "--spec-draft-p-min",
    help="Stop drafting when the draft's top probability falls below this.",
    rich_help_panel=DRAFTING)]
NoSpec = Annotated[bool, typer.Option(
    "--no-spec", help="Decode with the target alone.", rich_help_panel=DRAFTING)]

Temp = Annotated[float, typer.Option(
    "--temp", help="Temperature; 0 is greedy.", rich_help_panel=SAMPLING)]
TopK = Annotated[int, typer.Option("--top-k", help="Top-k; 0 disables.",
                                   rich_help_panel=SAMPLING)]
TopP = Annotated[float, typer.Option("--top-p", help="Top-p; 1.0 disables.",
                                     rich_help_panel=SAMPLING)]
MinP = Annotated[float, typer.Option("--min-p", help="Min-p; 0.0 disables.",
                                     rich_help_panel=SAMPLING)]
Seed = Annotated[int, typer.Option("-s", "--seed", help="RNG seed; -1 picks one at random.",
                                   rich_help_panel=SAMPLING)]

CtxSize = Annotated[int, typer.Option("-c", "--ctx-size", help="Target context size.",
                                      rich_help_panel=RESOURCES)]
CtxSizeDraft = Annotated[int | None, typer.Option(
    "-cd", "--ctx-size-draft", help="Draft context size. Default: same as -c.",
    rich_help_panel=RESOURCES, show_default=False)]
GpuLayers = Annotated[int, typer.Option(
    "-ngl", "--n-gpu-layers", "--gpu-layers", help="Target layers to offload to the GPU.",
    rich_help_panel=RESOURCES)]
GpuLayersDraft = Annotated[int, typer.Option(
    "-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft",
    help="Draft layers to offload to the GPU.", rich_help_panel=RESOURCES)]
Threads = Annotated[int, typer.Option(
    "-t", "--threads", help="Threads for generation. Default: the CPU count, at most 8.",
    rich_help_panel=RESOURCES, show_default=False)]
ThreadsDraft = Annotated[int | None, typer.Option(
    "-td", "--threads-draft", help="Draft threads. Default: same as -t.",
    rich_help_panel=RESOURCES, show_default=False)]
ThreadsBatch = Annotated[int | None, typer.Option(
    "-tb", "--threads-batch", help="Threads for batches and prompts. Default: same as -t.",
    rich_help_panel=RESOURCES, show_default=False)]
ThreadsBatchDraft = Annotated[int | None, typer.Option(
    "-tbd", "--threads-batch-draft", help="Draft batch threads. Default: same as -td.",
    rich_help_panel=RESOURCES, show_default=False)]
CacheTypeK = Annotated[str | None, typer.Option(
    "-ctk", "--cache-type-k", help="Target KV cache type for K (f16, q8_0, q4_0, ...).",
    rich_help_panel=RESOURCES, show_default=False)]
CacheTypeV = Annotated[str | None, typer.Option(
    "-ctv", "--cache-type-v", help="Target KV cache type for V.",
    rich_help_panel=RESOURCES, show_default=False)]
CacheTypeKDraft = Annotated[str | None, typer.Option(
    "-ctkd", "--cache-type-k-draft", help="Draft KV cache type for K.",
    rich_help_panel=RESOURCES, show_default=False)]
CacheTypeVDraft = Annotated[str | None, typer.Option(
    "-ctvd", "--cache-type-v-draft", help="Draft KV cache type for V.",
    rich_help_panel=RESOURCES, show_default=False)]
FlashAttnOpt = Annotated[FlashAttn, typer.Option(
    "-fa", "--flash-attn", help="Flash attention (llama.cpp's default: auto).",
    rich_help_panel=RESOURCES)]

Json = Annotated[bool, typer.Option(
    "--json", help="Print one JSON object on stdout: text and every statistic.",
    rich_help_panel=OUTPUT)]
Verbose = Annotated[bool, typer.Option(
    "-v", "--verbose", help="Show llama.cpp's own log on stderr.", rich_help_panel=OUTPUT)]

DEFAULTS = {
    "draft_max": config.DEFAULT_DRAFT_MAX,
    "ctx": config.DEFAULT_CTX,
    "threads": config.DEFAULT_THREADS,
    "n_predict": config.DEFAULT_N_PREDICT,
}
