"""`specli convert-head`: a published draft head (safetensors) into the GGUF llama.cpp loads,
against the user's GGUF target."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from specli.cli import options as o
from specli.cli.console import err, safe


def convert_head(
    checkpoint: Annotated[Path, typer.Argument(
        help="The head's folder: config.json and *.safetensors, as published on Hugging Face.",
        metavar="CHECKPOINT_DIR", show_default=False)],
    model: Annotated[Path, typer.Option(
        "-m", "--model", help="The target GGUF the head drafts for: its tokenizer, width, "
        "layer count and vocabulary stand in for the target's Hugging Face folder.",
        show_default=False)],
    outfile: Annotated[Path, typer.Option(
        "-o", "--outfile", help="The GGUF file to write (written to a temporary name beside "
        "it, then renamed).", show_default=False)],
    outtype: Annotated[str, typer.Option(
        "--outtype", help="Type of the head's matrices: auto (the checkpoint's own: bf16 or "
        "f16), f32, f16, bf16 or q8_0. Norms and vectors stay f32, as llama.cpp's converter "
        "writes them.")] = "auto",
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object on stdout: the file, head type, architecture, "
        "tensors, bytes and seconds.", rich_help_panel=o.OUTPUT)] = False,
) -> None:
    """Convert a draft head checkpoint to GGUF against a GGUF target.

    Reads the head's safetensors with numpy (no torch, no transformers) and takes from the
    target GGUF what llama.cpp's convert_hf_to_gguf.py --target-model-dir reads from the
    target's Hugging Face folder. EAGLE-3 layouts: SpecForge LlamaForCausalLMEagle3, vLLM /
    AngelSlim Eagle3LlamaForCausalLM, RedHat Eagle3Speculator, Eagle3DraftModel. DFlash and
    DSpark on Qwen3 blocks: DFlashDraftModel, Qwen3DSparkModel, DSparkDraftModel,
    DSparkSpeculator.

    Exit code 0: written; 2: the checkpoint or target cannot be converted (one line says why).
    """
    from specli.headconvert import convert_head as convert

    show = not json_out and err.is_terminal
    if show:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        with Progress(TextColumn("converting {task.description}"), BarColumn(),
                      MofNCompleteColumn(), console=err, transient=True) as bar:
            task = bar.add_task(checkpoint.name, total=None)

            def step(done: int, total: int, name: str) -> None:
                bar.update(task, completed=done, total=total)

            r = convert(checkpoint, str(model), outfile, outtype=outtype, progress=step)
    else:
        r = convert(checkpoint, str(model), outfile, outtype=outtype)
    if json_out:
        sys.stdout.write(json.dumps(r.to_dict()) + "\n")
        return
    err.print(f"{safe(r.architecture)} -> {r.spec_type}: {r.n_tensors} tensors, "
              f"{r.n_bytes / 2**20:.1f} MiB ({r.outtype}) in {r.seconds:.2f} s", markup=False)
    print(r.path)

