"""`specli audit`: run a generation and prove that it made no network connection."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from typing import Annotated

import typer

from specli import netguard
from specli.cli import options as o
from specli.cli import run as run_cmd
from specli.cli.console import err, safe
from specli.errors import SpecliError
from specli.generate import generate

AUDIT = "Audit"
BIG = 32 << 20  # files above this hash behind a progress bar


def _audit_flags(
    isolate: Annotated[bool, typer.Option(
        "--isolate", help="Run the generation in a new network namespace with no way out, so "
        "any attempt fails by construction (root, or unprivileged user namespaces); exit 2 if "
        "not permitted.", rich_help_panel=AUDIT)] = False,
    strict: Annotated[bool, typer.Option(
        "--strict", help="Fail on loopback and local sockets and on process starts too.",
        rich_help_panel=AUDIT)] = False,
    poll_ms: Annotated[int, typer.Option(
        "--poll-ms", help="How often the sockets of the process tree are read from /proc.",
        rich_help_panel=AUDIT)] = 20,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the report as one JSON object on stdout.",
        rich_help_panel=AUDIT)] = False,
) -> None:
    """The audit's own flags; the rest are `specli run`'s."""


def _audit(**kw) -> None:
    """Run a generation (same flags as `specli run`) and audit its network use.

    Records, for the whole run: every network call and process start made from Python (an
    audit hook in this process and in Python children), and every socket the process tree
    holds (/proc, polled). Reports the models loaded (path, size, sha256), the environment
    variables that could turn on network use, and the run's acceptance figures. Exit 0: no
    network use beyond loopback; 1: an attempt was seen (listed); 2: the audit could not run.
    """
    isolate, strict, poll_ms, json_out = (kw.pop(k) for k in
                                          ("isolate", "strict", "poll_ms", "json_out"))
    if poll_ms < 1:
        raise SpecliError(f"--poll-ms must be at least 1, got {poll_ms}")
    namespace = netguard.isolation() if isolate else None
    if isolate and namespace is None:  # re-execute this command in a new network namespace
        code = subprocess.run(netguard.isolated_command()).returncode
        if code not in (0, 1, 2):  # 1 means "network seen": a crash must not read as that
            raise netguard.AuditError(f"the isolated audit ended abnormally (exit {code})")
        raise typer.Exit(code)
    try:
        with netguard.Guard(interval=poll_ms / 1000) as guard:
            # resolving -hf models is inside the watch: a download is network use
            req = run_cmd.request(**kw, quiet=True)
            gen = generate(req)
    except (SpecliError, typer.Exit):
        raise
    except KeyboardInterrupt:
        raise netguard.AuditError("interrupted: no verdict") from None
    except Exception as e:  # exit 1 means "network seen": anything else unforeseen is 2
        raise netguard.AuditError(f"the audited run failed: {type(e).__name__}: {e}") from None
    models = [_model(role, p.path) for role, p in (("target", req.target),
                                                   ("draft", req.draft)) if p is not None]
    code, counted = netguard.verdict(guard.events, strict)
    report = {
        "schema_version": 1,
        "verdict": "network use seen" if code else "clean",
        "exit_code": code,
        "strict": strict,
        "isolated": namespace is not None,
        "namespace": namespace,
        "seconds": round(guard.seconds, 3),
        "poll": {"interval_ms": poll_ms, "polls": guard.polls},
        "models": models,
        "environment": netguard.network_environment(),
        "counted": [netguard.to_dict(e) for e in counted],
        "events": [netguard.to_dict(e) for e in guard.events],
        "run": _run_figures(gen.stats.to_dict()),
    }
    if json_out:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        _print(report, guard.events, counted)
    raise typer.Exit(code)


_own = list(inspect.signature(_audit_flags, eval_str=True).parameters.values())
_audit.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [p for p in inspect.signature(run_cmd.run.command, eval_str=True).parameters.values()
     if p.name not in ("baseline", "json_out")] + _own)
audit = o.grouped(_audit)


def _model(role: str, path: str) -> dict:
    size = os.path.getsize(path)
    name = os.path.basename(path)
    if size >= BIG and err.is_terminal:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

        with Progress(TextColumn("sha256 {task.description}"), BarColumn(), DownloadColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task(name, total=size)
            digest = netguard.file_sha256(path, lambda n: bar.advance(task, n))
    else:
        digest = netguard.file_sha256(path)
    return {"role": role, "path": os.path.abspath(path), "size": size, "sha256": digest}


def _run_figures(stats: dict) -> dict:
    keys = ("n_predict", "n_draft", "n_drafted", "n_accept", "accept_rate", "mean_accept_len",
            "decode_tps", "t_decode_s", "finish_reason")
    return {k: stats.get(k) for k in keys}


def _print(report: dict, events: list[netguard.NetEvent],
           counted: list[netguard.NetEvent]) -> None:
    w = sys.stdout.write
    w("=== specli network audit ===\n\n[ models loaded ]\n")
    for m in report["models"]:
        w(f"  {m['role']:6s} {safe(m['path'])}\n         {m['size'] / 2**20:.1f} MiB  "
          f"sha256 {m['sha256']}\n")
    w("\n[ environment ]\n")
    env = report["environment"]
    w("".join(f"  {k}={safe(v)}\n" for k, v in env.items()) or
      "  no HF_*, HUGGINGFACE_*, SPECLI_*, proxy or CA bundle variables set\n")
    ns = report["namespace"]
    w(f"\n[ network during the run: {report['seconds']:.1f} s, /proc polled "
      f"{report['poll']['polls']} times every {report['poll']['interval_ms']} ms ]\n")
    if ns:
        w(f"  isolated in a new {ns['how']} ({ns['netns']}): "
          f"{', '.join(ns['interfaces']) or 'no interfaces'}\n")
    groups = [("external", [e for e in events if e.scope == netguard.EXTERNAL
                            and not e.inherited]),
              ("loopback and local", [e for e in events if e.scope in (netguard.LOOPBACK,
                                                                       netguard.LOCAL)
                                      and not e.inherited]),
              ("processes started", [e for e in events if e.scope == netguard.PROCESS]),
              ("held before the audit began (not counted)", [e for e in events
                                                             if e.inherited])]
    if not groups[0][1]:
        w("  ✓ no external connections or attempts\n")
    for title, group in groups:
        if group or title != "held before the audit began (not counted)":
            w(f"  {title}: {len(group) or 'none'}\n")
        for e in group:
            w(f"    {_line(e)}\n")
    r = report["run"]
    w("\n[ speculative decoding ]\n")
    if r["n_drafted"]:
        w(f"  accepted tokens: {r['n_accept']} / {r['n_drafted']} drafted "
          f"({100 * r['accept_rate']:.1f}% acceptance rate)\n")
    else:
        w("  no tokens drafted\n")
    w(f"  tokens per second: {r['decode_tps']:.1f} t/s ({r['n_predict']} tokens)\n\n")
    if counted:
        w(f"verdict: NETWORK USE SEEN: {len(counted)} event(s) counted"
          f"{' (--strict)' if report['strict'] else ''}\n")
    else:
        w("verdict: clean: both models local, no network use beyond loopback"
          f"{' (none at all: --strict)' if report['strict'] else ''}\n")


def _line(e: netguard.NetEvent) -> str:
    what = f"{e.event} {safe(e.address)}"
    if e.proto:
        what += f" ({e.proto})"
    outcome = f" -> {e.outcome}" if e.outcome else ""
    return f"{e.t:7.3f}s pid {e.pid} [{e.source}] {what}{outcome}\n      by {safe(e.where)}"
