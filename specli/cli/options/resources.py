"""Resources: contexts, threads, KV cache, offloaded layers, of the target and the draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

import typer

from specli import config
from specli.cli.console import err
from specli.cli.options.gpu import GpuFlags
from specli.cli.options.group import RESOURCES, Group
from specli.errors import UsageError


class FlashAttn(StrEnum):
    on = "on"
    off = "off"
    auto = "auto"


@dataclass(frozen=True)
class Resources:
    """The context, thread, KV-cache and layer flags of the target and the draft; a draft
    value left out takes the target's, as in llama.cpp."""

    ctx: int = config.DEFAULT_CTX
    ctx_draft: int | None = None
    ngl: int = 0
    ngld: int = 0
    threads: int | None = None  # None: -t auto, measured (specli/threads.py)
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
    context_shift: bool = False
    keep: int = 0

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
                        given = "all" if n == ALL_LAYERS else n  # as the user wrote it
                        err.print(f"warning: no usable GPU found, {flag} {given} is ignored "
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
            warmup=self.warmup, context_shift=self.context_shift, n_keep=self.keep)
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
    threads: Annotated[str, _res_opt(
        "-t", "--threads", metavar="N|auto", help="Threads for generation. Default: auto: "
        "measured, each model's decodes timed at the counts that can win (1, 2, 4... up to "
        "the usable CPUs, at most 8) and the fastest kept, looked at again when the time a "
        "token drifts; the statistics say what it chose. On a machine with other work the "
        "CPU count (llama.cpp's default) can be many times slower than fewer threads.",
        envvar="LLAMA_ARG_THREADS", show_default=False)] = "auto",
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
    context_shift: Annotated[bool, _res_opt(
        "--context-shift/--no-context-shift", help="When the context is full, drop the "
        "older half of what follows the first --keep tokens and go on generating (llama.cpp's "
        "context shift; with a draft model or n-gram drafts too, not with a head or a draft "
        "tree). Off: the generation ends at a full context, as in llama.cpp.",
        envvar="LLAMA_ARG_CONTEXT_SHIFT")] = False,
    keep: Annotated[int, _res_opt(
        "--keep", metavar="N", help="Tokens of the prompt a context shift keeps (-1: all of "
        "it; a BOS is kept besides).")] = 0,
) -> Resources:
    if ctx_size < 16:
        raise UsageError(f"-c/--ctx-size must be at least 16, got {ctx_size}")
    if keep < -1:
        raise UsageError(f"--keep must be -1 (the whole prompt) or more, got {keep}")
    n_threads = parse_threads(threads)
    if batch_size < 2 or ubatch_size < 1:  # a verification needs room for a drafted token
        raise UsageError(f"-b/--batch-size must be at least 2 and -ub/--ubatch-size at least "
                         f"1, got {batch_size} and {ubatch_size}")
    return Resources(ctx_size, ctx_size_draft, parse_ngl(n_gpu_layers, "-ngl"),
                     parse_ngl(n_gpu_layers_draft, "-ngld"), n_threads,
                     threads_draft, threads_batch, threads_batch_draft, cache_type_k,
                     cache_type_v, cache_type_k_draft, cache_type_v_draft,
                     FlashAttn(flash_attn).value, batch_size, ubatch_size, mmap, mlock,
                     warmup, context_shift, keep)


RESOURCE_FLAGS = Group(_resource_flags)


ALL_LAYERS = 999  # more layers than any model has: every one of them


def parse_threads(value: str) -> int | None:
    """-t N|auto: a count, or None for auto (measured)."""
    v = value.strip().lower()
    if v == "auto":
        return None
    try:
        n = int(v)
    except ValueError:
        raise UsageError(f"-t/--threads takes a number or auto, got {value!r}") from None
    if n < 1:
        raise UsageError(f"-t/--threads must be at least 1, got {n}")
    return n


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


# the flags besides placement that shape how fast a model runs, by Resources field
_SPEED = (("-t", "threads"), ("-td", "threads_draft"), ("-tb", "threads_batch"),
          ("-tbd", "threads_batch_draft"), ("-ctk", "ctk"), ("-ctv", "ctv"),
          ("-ctkd", "ctkd"), ("-ctvd", "ctvd"), ("-fa", "flash_attn"), ("-b", "batch"),
          ("-ub", "ubatch"))


def speed_args(resources: Resources, gpu: GpuFlags) -> list[str]:
    """Every flag given that shapes the speed: the placement (placement_args), then the
    threads, batch sizes, cache types and flash attention that differ from the defaults, to
    repeat in a command that should run as fast as it was measured (tune-draft's best
    command: swept with -t 1 on a busy machine, the default ran 50x slower)."""
    default = Resources()
    args = placement_args(resources, gpu)
    for flag, name in _SPEED:
        value = getattr(resources, name)
        if value != getattr(default, name):
            args += [flag, str(getattr(value, "value", value))]
    return args


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
