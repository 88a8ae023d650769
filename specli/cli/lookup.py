"""`specli lookup create|merge|stats`: lookup caches for ngram-cache drafting, in llama.cpp's
file format (llama-lookup-create, llama-lookup-merge)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from specli import loadable
from specli.cli import options as o
from specli.cli.console import err
from specli.errors import SpecliError, UsageError

if TYPE_CHECKING:  # the drafts (and numpy) load when a command runs, not for --help
    from specli.drafts import lookup

app = typer.Typer(help="Build, merge and inspect lookup caches (-lcs/-lcd) for ngram-cache.",
                  no_args_is_help=True)

CHUNK_BYTES = 1 << 20  # tokenize and count a corpus a megabyte at a time


def _files(help: str):
    return typer.Argument(help=help, metavar="FILE...", show_default=False)


@app.command()
def create(
    file: Annotated[Path, typer.Option(
        "-f", "--file", help="The corpus: a UTF-8 text file.", show_default=False)],
    output: Annotated[Path, typer.Option(
        "-lcs", "--lookup-cache-static", "-o", "--output",
        help="Where to write the cache.", show_default=False)],
    model: Annotated[str | None, typer.Option(
        "-m", "--model", help="A GGUF model whose tokenizer to use (any of the family). "
        "Default: the embedded SmolLM2.", show_default=False)] = None,
    verbose: o.Verbose = False,
) -> None:
    """Build a static lookup cache from a text corpus, as llama-lookup-create does: every
    bigram of the corpus's tokens and what followed it. Use it with `specli run -lcs FILE`
    and the same tokenizer (model family)."""
    from specli.backend import Tokenizer
    from specli.drafts import lookup

    if model is None:
        from specli.defaults import default_pair

        model = default_pair()[0]
    size = _size(file)
    loadable.check_file(model)  # a vocabulary llama.cpp would abort on while tokenizing
    tok = Tokenizer(model, verbose)
    cache: lookup.Cache = {}
    n_tokens = 0
    try:
        with _progress(size) as bar, _open_text(file) as f:
            task = bar.add_task("counting bigrams", total=size)
            first = True
            tail: list[int] = []  # the previous chunk's last two tokens: n-grams span chunks
            chunk = f.read(CHUNK_BYTES)
            while chunk:
                chunk += f.readline()  # end chunks at a line break
                following = f.read(CHUNK_BYTES)
                if not following and chunk.endswith("\n"):
                    chunk = chunk[:-1]  # as llama.cpp's -f: one trailing newline goes
                tokens = tok.tokenize(chunk, add_special=first)
                first = False
                seq = tail + tokens
                lookup.update(cache, seq, len(tokens), lookup.NGRAM_STATIC, lookup.NGRAM_STATIC)
                tail = seq[-lookup.NGRAM_STATIC:]
                n_tokens += len(tokens)
                bar.update(task, advance=len(chunk.encode("utf-8")))
                chunk = following
    except UnicodeDecodeError as e:
        raise SpecliError(f"corpus {file} is not UTF-8 text: {e.reason} at byte {e.start}"
                          ) from None
    finally:
        tok.close()
    if not n_tokens:
        raise UsageError(f"corpus is empty: {file}")
    _save(cache, output, f"{file}: {n_tokens} tokens ->")


@app.command()
def merge(
    files: Annotated[list[Path], _files("Caches to merge, then the output file (last).")],
) -> None:
    """Merge lookup caches into one (counts add up), as llama-lookup-merge does: the last
    file named is the output, written atomically."""
    if len(files) < 2:
        raise UsageError("give at least one cache to merge and the output file",
                         hint="specli lookup merge a.bin b.bin merged.bin")
    *inputs, output = files
    from specli.drafts import lookup

    merged: lookup.Cache = {}
    for p in inputs:
        lookup.merge(merged, lookup.load(p))
    _save(merged, output, f"merged {len(inputs)} caches:")


@app.command()
def stats(
    files: Annotated[list[Path], _files("Lookup caches.")],
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the statistics as JSON on stdout (a list for several files).")
    ] = False,
) -> None:
    """Print the statistics of lookup caches: n-grams by length, distinct continuations,
    observations."""
    from specli.drafts import lookup

    rows = []
    for p in files:
        s = lookup.statistics(lookup.load(p))
        rows.append({"file": str(p), "bytes": p.stat().st_size, **s})
    if json_out:
        sys.stdout.write(json.dumps(rows if len(rows) > 1 else rows[0]) + "\n")
        return
    for r in rows:
        sizes = ", ".join(f"{k}-grams {v}" for k, v in r["ngrams_by_size"].items() if v)
        sys.stdout.write(f"{r['file']}\n"
                         f"  bytes         = {r['bytes']}\n"
                         f"  ngrams        = {r['ngrams']} ({sizes or 'none'})\n"
                         f"  continuations = {r['continuations']}\n"
                         f"  observations  = {r['observations']}\n")


def _save(cache: lookup.Cache, output: Path, what: str) -> None:
    from specli.drafts import lookup

    lookup.save(cache, output)
    s = lookup.statistics(cache)
    err.print(f"{what} {s['ngrams']} n-grams, {s['continuations']} continuations, "
              f"{s['observations']} observations; wrote {output}", markup=False)


def _size(file: Path) -> int:
    try:
        return file.stat().st_size
    except FileNotFoundError:
        raise SpecliError(f"corpus file not found: {file}") from None
    except OSError as e:
        raise SpecliError(f"cannot read corpus {file}: {e.strerror}") from None


def _open_text(file: Path):
    try:
        return open(file, encoding="utf-8", newline="")
    except OSError as e:
        raise SpecliError(f"cannot read corpus {file}: {e.strerror}") from None


def _progress(total: int) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TimeRemainingColumn(), console=err, transient=True,
                    disable=not err.is_terminal or total < CHUNK_BYTES)
