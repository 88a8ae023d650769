"""`specli check-pair`: will this draft work with this target? From the GGUF headers alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from specli import loadable
from specli.cli import options as o
from specli.cli.console import err, out, safe, spinner
from specli.errors import IncompatiblePairError, UsageError
from specli.headmeta import check_head, head_info
from specli.pairing import PairReport, compare, read_model_info
from specli.tuning import ProbeResult

SCHEMA_VERSION = 1
_STYLE = {"ok": "green", "fail": "bold red", "warn": "yellow", "info": "dim"}
_LABEL = {"ok": "ok", "fail": "FAIL", "warn": "warn", "info": ""}
PROBE_RESOURCES = o.RESOURCE_FLAGS.with_defaults(ctx_size=2048)  # probe prompts are short


@o.grouped
def check_pair(
    target: Annotated[Path, typer.Argument(help="The target GGUF model.", metavar="TARGET",
                                           show_default=False)],
    draft: Annotated[Path, typer.Argument(help="The draft GGUF model, or a draft head's "
                                          "safetensors checkpoint folder.", metavar="DRAFT",
                                          show_default=False)],
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object on stdout instead of the table.",
        rich_help_panel=o.OUTPUT)] = False,
    probe: Annotated[bool, typer.Option(
        "--probe", help="Also load both models and measure acceptance and speedup on a few "
        "built-in prompts (code, structured, chat), greedy.", rich_help_panel="Probe")] = False,
    n_predict: Annotated[int, typer.Option(
        "-n", "--n-predict", help="Tokens to generate per probe prompt.",
        rich_help_panel="Probe")] = 64,
    draft_max: Annotated[int, typer.Option(
        "--draft", "--draft-max", "--spec-draft-n-max",
        help="Draft length to probe with; the suggestion is at most this.",
        rich_help_panel="Probe")] = 8,
    resources: o.Resources = PROBE_RESOURCES,
    gpu: o.GpuFlags = o.GPU_FLAGS,
    verbose: o.Verbose = False,
) -> None:
    """Check that a draft can speculate for a target, from the GGUF headers alone.

    No weights are read. llama.cpp's rules decide (vocab type, BOS, EOS, vocab sizes within
    128, identical token text from id 5); warnings do not fail (pre-tokenizer, chat template,
    relative size, architecture family). --probe also loads both and measures.

    Exit code 0: compatible; 1: incompatible; 2: a file is missing or not a valid GGUF.
    """
    if n_predict < 1 or draft_max < 1:
        raise UsageError("-n/--n-predict and --draft must be at least 1")
    if draft.is_dir():  # a published head's checkpoint, before any conversion
        return _checkpoint(target, draft, json_out)
    headers = [loadable.check_file(str(path)) for path in (target, draft)]  # a file run
    report = compare(read_model_info(str(target)), read_model_info(str(draft)))  # refuses or
    head, head_problem = head_info(headers[1]), None  # aborts on gets no verdict
    if head is not None:  # a draft head: it must fit the target too
        try:
            check_head(headers[0], head, headers[1])
        except IncompatiblePairError as e:
            head_problem = e.message
    result = None
    ok = report.verdict.ok and head_problem is None
    if probe and ok:
        result = _probe(report, n_predict, draft_max, resources, gpu, verbose, quiet=json_out)
    if json_out:
        doc = {"schema_version": SCHEMA_VERSION, **report.to_dict(),
               "probe": result.to_dict() if result else None}
        if head is not None:  # a head's fit to the target (no key for a draft model)
            doc["head"] = {**head.to_dict(), "ok": head_problem is None,
                           "problem": head_problem}
        if head_problem is not None and doc["compatible"]:
            doc.update(compatible=False, rule="head", message=head_problem)
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        if head is not None:
            out.print(f"draft head: {head.text()}", markup=False)
        _print(report, result, head_problem)
    if not ok:
        raise typer.Exit(1)


def _checkpoint(target: Path, checkpoint: Path, json_out: bool) -> None:
    """A head checkpoint against a target: everything convert-head checks, from headers."""
    from specli.headckpt import HeadMismatch, describe
    from specli.headconvert import plan_head

    loadable.check_file(str(target))
    info = describe(checkpoint)
    problem = None
    try:
        plan_head(checkpoint, str(target))
    except HeadMismatch as e:
        problem = e.message
    if json_out:
        sys.stdout.write(json.dumps({"schema_version": SCHEMA_VERSION, "target": str(target),
                                     "checkpoint": info.to_dict(), "compatible": problem is None,
                                     "rule": None if problem is None else "head",
                                     "message": problem}, indent=2) + "\n")
    else:
        out.print(f"target: {safe(str(target))}", markup=False)
        out.print(f"head checkpoint: {safe(info.path)}", markup=False)
        out.print(f"draft head: {safe(info.text())}", markup=False)
        out.print("verdict: " + ("compatible: `specli convert-head` converts it" if problem is None
                                 else f"incompatible (head): {safe(problem)}"), markup=False)
    if problem is not None:
        raise typer.Exit(1)


def _probe(report: PairReport, n_predict: int, k: int, resources: o.Resources,
           gpu: o.GpuFlags, verbose: bool, quiet: bool) -> ProbeResult:
    from specli.config import DraftPolicy
    from specli.plan import load
    from specli.tuning import probe

    target, draft = resources.model_params(report.target.path, report.draft.path,
                                           verbose=verbose, gpu=gpu)
    with spinner("loading both models", quiet):
        engine = load(target, draft, DraftPolicy(n_max=k))
    try:
        with spinner("probing", quiet) as status:
            def progress(msg: str) -> None:
                if status is not None:
                    status.update(msg)
            return probe(engine, n_predict, progress=progress)
    finally:
        engine.close()


def _print(report: PairReport, result: ProbeResult | None,
           head_problem: str | None = None) -> None:
    out.print(f"target: {safe(report.target.path)}", markup=False)
    out.print(f"draft:  {safe(report.draft.path)}", markup=False)
    table = Table(show_edge=False, pad_edge=False)
    for name in ("field", "target", "draft", "status"):
        table.add_column(name)
    for r in report.rows:
        # metadata strings are the file's: shown as text, never parsed as Rich markup
        table.add_row(Text(r.field), Text(safe(r.target)), Text(safe(r.draft)),
                      Text(_LABEL[r.status], style=_STYLE[r.status]))
    out.print(table)
    for r in report.rows:
        if r.status in ("fail", "warn"):
            out.print(f"{_LABEL[r.status]}: {r.field}: {safe(r.note)}", markup=False)
        elif r.status == "ok" and r.note:  # why a difference passes (ids not compared)
            out.print(f"ok: {r.field}: {safe(r.note)}", markup=False)
    if result is not None:
        _print_probe(result)
    v = report.verdict
    if v.ok and head_problem is not None:
        out.print(f"verdict: incompatible (head): {safe(head_problem)}", markup=False)
    elif v.ok:
        n = len(report.warnings)
        tail = f", {n} warning{'s' * (n != 1)}" if n else ""
        out.print(f"verdict: compatible{tail}", markup=False)
    else:
        out.print("translation: `specli run/serve --spec-type draft-translate` can still use "
                  "this draft, its drafts turned into text and the text into the target's "
                  "tokens (expect less acceptance than a draft of the target's family)",
                  markup=False)
        out.print(f"verdict: incompatible ({v.rule}): {safe(v.message)}", markup=False)


def _print_probe(p: ProbeResult) -> None:
    table = Table(title=f"probe: greedy, --draft {p.n_draft}", show_edge=False, pad_edge=False)
    for name in ("prompt", "tokens", "drafted", "accepted", "rate", "target t/s", "spec t/s",
                 "speedup"):
        table.add_column(name, justify="left" if name == "prompt" else "right", no_wrap=True,
                         min_width=len(name))
    for r in p.rows:
        table.add_row(r.kind, str(r.n_predict), str(r.n_drafted), str(r.n_accept),
                      f"{r.accept_rate:.1%}", f"{r.baseline_tps:.1f}",
                      f"{r.speculative_tps:.1f}", f"{r.speedup:.2f}x")
    out.print(table)
    out.print(f"acceptance {p.accept_rate:.1%}, speedup {p.speedup:.2f}x", markup=False)
    out.print(f"recommendation: {p.recommendation}", markup=False)
    if not all(r.identical for r in p.rows):
        err.print("note: greedy speculative output differed from the target alone's on some "
                  "prompt: batched and single-token decodes round differently on quantized "
                  "targets", markup=False)
