"""`specli audit`: run a generation and prove that it made no network connection."""

from __future__ import annotations

import inspect
import json
import os
import sys
from typing import Annotated

import typer

from specli.audit._site import boot
from specli.audit.auditor import Auditor
from specli.audit.environment import network_environment, standard_streams
from specli.audit.events import (
    EXTERNAL,
    LOCAL,
    LOOPBACK,
    OUTLIVED,
    PROCESS,
    RESULT_ENV,
    AuditError,
    NetEvent,
)
from specli.audit.isolation import isolate_self, isolation_probe, stray_children
from specli.audit.verdict import to_dict, verdict
from specli.cli import audit_boot
from specli.cli import options as o
from specli.cli import run as run_cmd
from specli.cli.console import err, safe
from specli.errors import SpecliError
from specli.generate import generate
from specli.ggufmeta import file_sha256

AUDIT = "Audit"
BIG = 32 << 20  # files above this hash behind a progress bar


def _audit_flags(
    isolate: Annotated[bool, typer.Option(
        "--isolate/--no-isolate", help="Run the generation in a new network namespace with "
        "no way out (the default: the verdict is then a proof). --no-isolate keeps the real "
        "network up, for runs that need it: the verdict is then an observation.",
        rich_help_panel=AUDIT)] = True,
    allow_unproven: Annotated[bool, typer.Option(
        "--allow-unproven", "--allow-unisolated", help="Where a proof is not possible (this "
        "system refuses a network namespace; code from the environment, such as a "
        "sitecustomize, ran in specli audit before it could watch; stdin, stdout or stderr "
        "is a socket), audit anyway: the verdict is then an observation, said so, instead of "
        "exit 2.", rich_help_panel=AUDIT)] = False,
    strict: Annotated[bool, typer.Option(
        "--strict", help="Fail on loopback and local sockets and on process starts too.",
        rich_help_panel=AUDIT)] = False,
    grace: Annotated[float, typer.Option(
        "--grace", help="Seconds to wait, after the generation ends, for the processes it "
        "started; what is still running then is killed and counted.", min=0, max=3600,
        rich_help_panel=AUDIT)] = 2.0,
    poll_ms: Annotated[int, typer.Option(
        "--poll-ms", help="How often the sockets of the process tree are read from /proc.",
        rich_help_panel=AUDIT)] = 20,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the report as one JSON object on stdout.",
        rich_help_panel=AUDIT)] = False,
    show_text: Annotated[bool, typer.Option(
        "--show-text", help="Put the generated text in the report (its \"text\" with --json).",
        rich_help_panel=AUDIT)] = False,
) -> None:
    """The audit's own flags; the rest are `specli run`'s."""


BLIND_ISOLATED = [
    "what the run writes to stdout and stderr goes where you sent them (a pipe into nc is "
    "your connection, not the run's; a socket there is refused)",
    "data the run leaves in files, which another program could send later",
    "code from the environment that ran before specli audit re-executed itself (listed when "
    "found: sitecustomize, .pth files no package owns, PYTHONPATH modules), and a process it "
    "left outside the audited tree",
]
BLIND_UNISOLATED = [
    "nothing is stopped: what is reported has happened",
    "a destination rewritten by another thread between the report and the call (seccomp "
    "user notification reads it first)",
    "network use by another process on the run's behalf, reached over loopback or a unix "
    "socket with a path (docker, nscd, a proxy): listed, counted only with --strict",
    *BLIND_ISOLATED,
]
BLIND_NO_SECCOMP = [
    "C-level connections and datagrams shorter than the /proc poll interval",
    "raw syscalls, and children that ignore PYTHONPATH, between two polls",
]


def _audit(**kw) -> None:
    """Run a generation (same flags as `specli run`) and audit its network use.

    The generation runs in a child process, watched from its first instruction to the exit of
    the last process it started. By default it runs in a new network namespace with no way
    out, so a clean verdict is a proof; every attempt is still recorded (a seccomp listener
    for every connect, bind, send with an address and program start, C code included, which
    isolated makes each network call itself and refuses unix socket paths; an audit hook for
    Python; /proc for the sockets held). Reports the models loaded (path, size, sha256), the
    environment variables that could turn on network use, and the run's acceptance figures.
    Exit 0: no network use beyond loopback; 1: an attempt was seen (listed), or a process
    outlived the run; 2: the audit could not run, or a proof is not possible here (see
    --allow-unproven).
    """
    isolate, allow, strict, grace, poll_ms, json_out, show_text = (
        kw.pop(k) for k in ("isolate", "allow_unproven", "strict", "grace", "poll_ms",
                            "json_out", "show_text"))
    if os.environ.get(boot.ROLE_ENV) == "audited":
        return _audited(kw)
    if poll_ms < 1:
        raise SpecliError(f"--poll-ms must be at least 1, got {poll_ms}")
    if sys.argv[1:2] != ["audit"]:
        raise AuditError("specli audit re-executes its command line, and this process "
                                  "was not started as `specli audit ...`")
    if not (sys.flags.isolated and sys.flags.no_site):  # first: the environment's code ends
        audit_boot.reexec(["specli", *sys.argv[1:]])  # here (exec), then never runs again
    import time

    t0 = time.time()
    cfg = json.loads(os.environ.pop(audit_boot.AUDITOR_ENV, "{}") or "{}")
    before = stray_children(t0)  # started by that code, before the exec: killed
    env_code = list(cfg.get("env_code") or [])
    streams = standard_streams()
    unproven = []
    if env_code or before:
        unproven.append("code from the environment ran in specli audit before it could watch "
                        "it (" + "; ".join(env_code or [e.address for e in before]) + ")")
    unproven += [f"{e.address.split(':', 1)[0]} is a socket ({e.address.split(': ', 1)[1]}): "
                 "what the run writes there leaves the audit's reach" for e in streams]
    how, refused = isolation_probe() if isolate else ("", "")
    refused = refused or None
    landlock = bool(isolate and not refused and boot.landlock_abi())
    if isolate and not refused and not landlock and "user" not in how:
        # a user namespace of its own keeps the run out of the user's other processes; root
        # without one reaches them through /proc (their memory), unless Landlock stops it
        unproven.append("user namespaces are off and this kernel has no Landlock, so the run "
                        "could reach into other processes, outside its namespace, through "
                        "/proc (their memory, their descriptors)")
    gpu = kw.get("gpu")
    if isolate and not refused and gpu is not None and gpu.rpc:
        raise AuditError(
            "--rpc reaches its RPC servers over the network, which an isolated run does not "
            "have", hint="--no-isolate audits it with the network up: connections to the "
            "servers are listed, and counted unless they are on loopback (or with --strict)")
    if refused and not allow:
        raise AuditError(
            f"network isolation is not permitted here ({refused}): a clean verdict could only "
            "be an observation", hint="--allow-unproven accepts that; --no-isolate never "
            "isolates; root or unprivileged user namespaces make it a proof")
    if isolate and not refused and unproven and not allow:
        raise AuditError(
            f"{unproven[0]}: a clean verdict could only be an observation",
            hint="--allow-unproven accepts that" + (
                "; start specli audit without that code (PYTHONPATH, sitecustomize, .pth, "
                "LD_PRELOAD) for a proof" if env_code or before else
                "; send stdin, stdout and stderr to a terminal, a file or a pipe for a proof"
                if streams else "; a kernel with Landlock (Linux 5.13+) makes it a proof"))
    if isolate and not refused:  # the auditor needs no network either: whatever code runs
        isolate_self()   # in it (a dependency's) has none from here on
    try:
        audit = Auditor(["specli", *sys.argv[1:]], isolate and not refused,
                                 poll_ms / 1000, grace, run_path=cfg.get("run_path"),
                                 user_site=cfg.get("user_site"), landlock=landlock).run()
    except KeyboardInterrupt:
        raise AuditError("interrupted: no verdict") from None
    result = audit.result or {}
    failed = audit.exit_code != 0 or not audit.result or "error" in result
    if failed and audit.exit_code not in (0, 2):  # 2: the audited run said why, in one line
        err.print(f"error: the audited run ended abnormally (exit {audit.exit_code})",
                  markup=False, highlight=False)
    models = [_model(role, path) for role, path in result.get("models", ())]
    events = sorted(before + streams + audit.events, key=lambda e: e.t)
    code, counted = verdict(events, strict)
    if failed and code == 0:
        code = 2  # nothing seen, but the run did not run: no verdict
    if audit.isolated:
        mode, blind = "isolated", list(BLIND_ISOLATED)
    else:
        mode = "unisolated (isolation refused)" if refused else "unisolated (--no-isolate)"
        blind = list(BLIND_UNISOLATED)
    if audit.seccomp:
        blind += BLIND_NO_SECCOMP
        if audit.isolated:  # isolated, the listener is what closes unix sockets and races
            unproven.append(f"the seccomp listener could not run ({audit.seccomp}), so unix "
                            "socket paths were not refused")
    if code == 0 and audit.isolated and unproven and not allow:
        code = 2  # a proof was expected: no verdict (the report says why)
    report = {
        "schema_version": 4,
        "verdict": "network use seen" if code == 1 else "no verdict: the run failed"
        if failed else "clean",
        "exit_code": code,
        "proof": bool(audit.isolated) and not unproven and not failed,
        "unproven": unproven,
        "mode": mode,
        "strict": strict,
        "isolated": audit.isolated is not None,
        "namespace": audit.isolated,
        "isolation_refused": refused,
        "seccomp": {"active": not audit.seccomp, "reason": audit.seccomp or None},
        "blind_spots": blind,
        "seconds": round(audit.seconds, 3),
        "grace_s": grace,
        "outlived": audit.outlived,
        "poll": {"interval_ms": poll_ms, "polls": audit.polls},
        "models": models,
        "environment": network_environment(),
        "counted": [to_dict(e) for e in counted],
        "events": [to_dict(e) for e in events],
        "run": None if failed else _run_figures(result["stats"]),
        "run_error": {"exit_code": audit.exit_code, "message": result.get("error")}
        if failed else None,
    }
    if show_text:
        report["text"] = result.get("text")
    if json_out:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        _print(report, events, counted)
    raise typer.Exit(code)


def _audited(kw: dict) -> None:
    """The audited process (started by the auditor through boot.py): the generation, and what
    the auditor reports about it, into the file it named."""
    from specli import template_host

    # a chat template renders in this process: an audited run starts no helper process or
    # socket pair of specli's own (--strict counts both)
    template_host.configure(0)
    try:
        req = run_cmd.request(**kw, quiet=True)  # resolving -hf models is watched too
        gen = generate(req)
    except SpecliError as e:  # the report says why the run failed, as the run did
        _result({"error": e.message + (f" (hint: {e.hint})" if e.hint else "")})
        raise
    except typer.Exit:
        raise
    except Exception as e:  # exit 1 means "network seen": anything unforeseen is 2
        _result({"error": f"{type(e).__name__}: {e}"})
        raise AuditError(f"the audited run failed: {type(e).__name__}: {e}") from None
    _result({"models": [(role, p.path) for role, p in (("target", req.target),
                                                        ("draft", req.draft)) if p is not None],
             "stats": gen.stats.to_dict(), "text": gen.text})


def _result(doc: dict) -> None:
    """What the audited process tells the auditor, into the file it named."""
    with open(os.environ[RESULT_ENV], "w", encoding="utf-8") as f:
        json.dump(doc, f)


_own = list(inspect.signature(_audit_flags, eval_str=True).parameters.values())
_audit.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [p for p in inspect.signature(run_cmd.run.command, eval_str=True).parameters.values()
     if p.name not in ("baseline", "json_out", "log_disable")] + _own)
audit = o.grouped(_audit)


def _model(role: str, path: str) -> dict:
    size = os.path.getsize(path)
    name = os.path.basename(path)
    if size >= BIG and err.is_terminal:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

        with Progress(TextColumn("sha256 {task.description}"), BarColumn(), DownloadColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task(name, total=size)
            digest = file_sha256(path, lambda n: bar.advance(task, n))
    else:
        digest = file_sha256(path)
    return {"role": role, "path": os.path.abspath(path), "size": size, "sha256": digest}


def _run_figures(stats: dict) -> dict:
    keys = ("n_predict", "n_draft", "n_drafted", "n_accept", "accept_rate", "mean_accept_len",
            "decode_tps", "t_decode_s", "finish_reason")
    return {k: stats.get(k) for k in keys}


def _print(report: dict, events: list[NetEvent],
           counted: list[NetEvent]) -> None:
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
        w(f"  isolated: network namespace {ns['netns']} with only "
          f"{', '.join(ns['interfaces']) or 'no interfaces'}, checked from outside\n")
    else:
        w(f"  not isolated: {report['mode']}\n")
    sc = report["seccomp"]
    w("  every connect and addressed send of the process tree recorded (seccomp)\n"
      if sc["active"] else f"  no seccomp listener ({safe(sc['reason'])})\n")
    groups = [("external", [e for e in events if e.scope == EXTERNAL
                            and not e.inherited]),
              ("loopback and local", [e for e in events if e.scope in (LOOPBACK,
                                                                       LOCAL)
                                      and not e.inherited]),
              ("processes started", [e for e in events if e.scope == PROCESS]),
              ("outlived the run (killed)", [e for e in events
                                             if e.scope == OUTLIVED]),
              ("held before the audit began (not counted)", [e for e in events
                                                             if e.inherited])]
    if not groups[0][1]:
        w("  ✓ no external connections or attempts\n")
    for title, group in groups:
        if group or title not in ("held before the audit began (not counted)",
                                  "outlived the run (killed)"):
            w(f"  {title}: {len(group) or 'none'}\n")
        for e in group:
            w(f"    {_line(e)}\n")
    r = report["run"]
    w("\n[ speculative decoding ]\n")
    if r is None:
        e = report["run_error"]
        w(f"  the run failed (exit {e['exit_code']})"
          + (f": {safe(e['message'])}" if e["message"] else "") + "\n\n")
    elif r["n_drafted"]:
        w(f"  accepted tokens: {r['n_accept']} / {r['n_drafted']} drafted "
          f"({100 * r['accept_rate']:.1f}% acceptance rate)\n")
    else:
        w("  no tokens drafted\n")
    if r is not None:
        w(f"  tokens per second: {r['decode_tps']:.1f} t/s ({r['n_predict']} tokens)\n\n")
    if "text" in report:
        w("[ generated text ]\n" + "".join(f"  {safe(line)}\n" for line in
                                             (report["text"] or "").split("\n")) + "\n")
    title = "what this audit cannot see" if report["proof"] else \
        "blind spots of an unisolated audit" if not report["namespace"] else \
        "why this is no proof, and what the audit cannot see"
    w(f"[ {title} ]\n" + "".join(f"  - {b}\n" for b in [*report["unproven"],
                                                        *report["blind_spots"]]) + "\n")
    if counted:
        how = ("none could leave this machine (isolated)" if report["namespace"]
               else "observed, not isolated")
        w(f"verdict: NETWORK USE SEEN: {len(counted)} event(s) counted"
          f"{' (--strict)' if report['strict'] else ''}: {how}\n")
    elif report["run"] is None:
        w("verdict: none: the audited run failed before it could finish; no network use "
          "seen until then\n")
    elif report["proof"]:
        w("verdict: clean, proven: no network connection from the run's processes could leave "
          "this machine (network namespace with only lo), and none was attempted beyond "
          "loopback"
          f"{' (none at all: --strict)' if report['strict'] else ''}\n")
    else:
        why = "not isolated" if not report["namespace"] else "see above"
        w(f"verdict: clean, observed (not a proof: {why}; blind spots above): both "
          "models local, no network use beyond loopback seen"
          f"{' (none at all: --strict)' if report['strict'] else ''}\n")


def _line(e: NetEvent) -> str:
    what = f"{e.event} {safe(e.address)}"
    if e.proto:
        what += f" ({e.proto})"
    outcome = f" -> {e.outcome}" if e.outcome else ""
    return f"{e.t:7.3f}s pid {e.pid} [{e.source}] {what}{outcome}\n      by {safe(e.where)}"
