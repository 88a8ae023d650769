"""`specli download`: GGUF models (or a recommended pair) from Hugging Face, into the standard
cache; and the -hf/-hfd resolution that `run` and `serve` share."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from specli.cli import options as o
from specli.cli.console import err, out
from specli.errors import UsageError

HUB = "Hugging Face"

SIDECAR = "Draft-head sidecars"
HfToken = Annotated[str | None, typer.Option(
    "-hft", "--hf-token", help="Hugging Face token (default: HF_TOKEN or the saved login).",
    rich_help_panel=HUB, show_default=False)]


def download(
    ref: Annotated[str | None, typer.Argument(
        help="owner/name[:QUANT], e.g. bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M. Without "
        "a quant: Q4_K_M, then Q8_0, then the first GGUF.", metavar="REPO[:QUANT]",
        show_default=False)] = None,
    file: Annotated[str | None, typer.Option(
        "-hff", "--file", "--hf-file", help="A file of the repository, instead of a quant tag.",
        show_default=False)] = None,
    pair_name: Annotated[str | None, typer.Option(
        "--pair", help="Download a recommended target + draft pair, then check it.",
        show_default=False)] = None,
    list_pairs: Annotated[bool, typer.Option(
        "--list-pairs", help="Show the pair presets and exit.")] = False,
    local_dir: Annotated[Path | None, typer.Option(
        "--local-dir", help="Download into this folder (like `hf download --local-dir`) "
        "instead of the Hugging Face cache.", show_default=False)] = None,
    revision: Annotated[str | None, typer.Option(
        "--revision", help="A branch, tag or commit of the repository.",
        show_default=False)] = None,
    hf_token: HfToken = None,
    quiet: Annotated[bool, typer.Option(
        "-q", "--quiet", help="No progress bars.")] = False,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print JSON on stdout: the repository, tag, revision and files "
        "downloaded (with --pair both paths and the check-pair report; with --list-pairs the "
        "pairs).", rich_help_panel=o.OUTPUT)] = False,
    mtp: Annotated[bool, typer.Option(
        "--mtp", help="Also download the MTP sidecar (mtp-*.gguf), if available.",
        rich_help_panel=SIDECAR)] = False,
    dflash: Annotated[bool, typer.Option(
        "--dflash", help="Also download the DFlash sidecar (dflash-*.gguf), if available.",
        rich_help_panel=SIDECAR)] = False,
    eagle3: Annotated[bool, typer.Option(
        "--eagle3", help="Also download the Eagle3 sidecar (eagle3-*.gguf), if available.",
        rich_help_panel=SIDECAR)] = False,
    dspark: Annotated[bool, typer.Option(
        "--dspark", help="Also download the DSpark sidecar (dspark-*.gguf), if available.",
        rich_help_panel=SIDECAR)] = False,
    model: Annotated[Path | None, typer.Option(
        "-m", "--model", help="The target GGUF a head checkpoint is converted against: with "
        "--eagle3 (or --dflash, --dspark) on a repository that publishes the head as "
        "safetensors, not GGUF; the converted head is cached, keyed by the head's commit "
        "and the target's sha256.", rich_help_panel=SIDECAR, show_default=False)] = None,
) -> None:
    """Download GGUF files from Hugging Face into the cache other tools share.

    The last line on stdout is the local path of the model (the first part of a split one),
    so `path=$(specli download REPO:Q4_K_M | tail -1)` works; a sidecar asked for comes on a
    line of its own before it (--mtp, --dflash, --eagle3, --dspark: a draft head the repository
    ships beside the model, as llama.cpp's --mtp and --dflash fetch). Interrupted downloads resume;
    each file is checked against the hub's sha256. HF_HOME, HF_HUB_CACHE, HF_ENDPOINT,
    HF_TOKEN and HF_HUB_OFFLINE are honoured.
    """
    from specli import hub

    if list_pairs:
        return _list_pairs(json_out)
    if (ref is None) == (pair_name is None):
        raise UsageError("give a repository (REPO[:QUANT]) or --pair NAME",
                         hint="specli download --list-pairs shows the presets")
    progress = not quiet and not json_out and err.is_terminal
    if quiet or json_out:
        hub.quiet()
    if pair_name is not None:
        if file is not None or revision is not None:
            raise UsageError("--file and --revision name one repository's file or version: "
                             "they do not go with --pair")
        return _pair(hub.pair(pair_name), revision, hf_token, local_dir, progress, json_out)
    r = hub.parse_ref(ref)
    where = str(local_dir) if local_dir else None
    say = None if progress or json_out else _say
    kinds = [t for t, on in (("draft-mtp", mtp), ("draft-dspark", dspark),
                             ("draft-dflash", dflash), ("draft-eagle3", eagle3)) if on]
    heads = hub.fetch_sidecars(r, kinds, revision, hf_token, where, progress, say) \
        if kinds else {}
    missing = [k for k in kinds if k not in heads]
    listing = hub.checkpoint_listing(r, revision, hf_token) if missing and file is None \
        else None
    if listing is not None:
        if model is None:
            raise UsageError(f"{r.repo} publishes its head as safetensors: give the target "
                             "GGUF to convert it against with -m", hint="specli download "
                             f"--{missing[0].removeprefix('draft-')} {r.repo} -m target.gguf")
        from specli.cli.models import head_from_hub

        path, kind = head_from_hub(r, str(model), hf_token, missing, quiet or json_out,
                                   revision, listing)
        heads[kind] = Path(path)
    for kind in kinds:
        if kind not in heads:
            err.print(f"note: {r.repo} ships no {hub.SIDECARS[kind]}*.gguf sidecar",
                      markup=False)
    try:
        paths = hub.fetch(r, file, revision, hf_token, where, progress, on_file=say)
    except hub.HubError:
        if not heads:  # a sidecar asked for can come without a model of its tag
            raise
        paths = []
    if json_out:
        doc = {"repo": r.repo, "tag": r.tag, "revision": revision,
               "files": [str(p) for p in paths], "path": str(paths[0]) if paths else None}
        if kinds:
            doc["sidecars"] = {k.removeprefix("draft-"): str(p) for k, p in heads.items()}
        out.print_json(json.dumps(doc))
        return
    sys.stdout.write("".join(f"{p}\n" for p in [*heads.values(), *paths[:1]]))


def _say(name: str) -> None:
    err.print(f"downloading {name}", markup=False)


def _list_pairs(json_out: bool) -> None:
    from rich.table import Table

    from specli import hub

    presets = hub.pairs()
    if json_out:
        out.print_json(json.dumps([{"name": p.name, "target": str(p.target),
                                    "draft": str(p.draft), "head": p.head, "note": p.note}
                                   for p in presets]))
        return

    def draft(p) -> str:
        return f"{p.draft} ({p.head} head)" if p.head else str(p.draft)

    if not out.is_terminal:  # a log or a pipe: one whole record per line, never cut
        for p in presets:
            sys.stdout.write(f"{p.name}: target {p.target}, draft {draft(p)} ({p.note})\n")
        return
    table = Table(show_edge=False, pad_edge=False)
    for name in ("pair", "target", "draft", "note"):
        table.add_column(name, overflow="fold")
    for p in presets:
        table.add_row(p.name, str(p.target), draft(p), p.note)
    out.print(table)


def _pair(p, revision, token, local_dir, progress: bool, json_out: bool) -> None:
    from specli import hub
    from specli.pairing import compare, read_model_info

    got = {}
    for role, ref in (("target", p.target), ("draft", p.draft))[:1 if p.head else 2]:
        paths = hub.fetch(ref, None, revision, token, str(local_dir) if local_dir else None,
                          progress, on_file=None if progress or json_out else _say)
        got[role] = str(paths[0])
    if p.head:  # a published head: its checkpoint converted against the target
        from specli.cli.models import head_from_hub

        got["draft"], _ = head_from_hub(p.draft, got["target"], token, [p.head],
                                        json_out or not progress)
        if json_out:
            out.print_json(json.dumps({"pair": p.name, **got, "spec_type": p.head}))
        else:
            err.print(f"run it: specli run -m {got['target']} -md {got['draft']} "
                      f"--spec-type {p.head}", markup=False, soft_wrap=True)
            sys.stdout.write(f"{got['target']}\n{got['draft']}\n")
        return
    report = compare(read_model_info(got["target"]), read_model_info(got["draft"]))
    if json_out:
        out.print_json(json.dumps({"pair": p.name, **got, "check_pair": report.to_dict()}))
    else:
        v = report.verdict
        err.print(f"check-pair: {'compatible' if v.ok else f'incompatible ({v.rule}): '}"
                  f"{'' if v.ok else v.message}", markup=False)
        sys.stdout.write(f"{got['target']}\n{got['draft']}\n")
    if not report.verdict.ok:
        raise typer.Exit(1)
