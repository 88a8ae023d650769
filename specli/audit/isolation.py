"""The network namespace: moving into one, probing whether this host allows it, and the
processes a run leaves behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

from specli.audit.events import OUTLIVED, AuditError, NetEvent
from specli.audit.poller import cmdline, descendants


def isolate_self() -> None:
    """Move this process (the auditor, single-threaded yet) into a network namespace of its
    own, as the audited one will be: it needs no network for an isolated audit, so nothing
    that runs in it can reach one. AuditError if the kernel refuses."""
    from specli.audit._site import boot

    how, why = boot.isolate(drop=False)
    if not how:
        raise AuditError(f"the auditor could not isolate itself: {why}")


def stray_children(t0: float) -> list[NetEvent]:
    """Processes this one started before it watched anything (the environment's code, before
    the re-exec): killed, and reported as such."""
    out = []
    me = os.getpid()
    for pid in descendants(me)[1:]:
        out.append(NetEvent("started before the audit", OUTLIVED, pid, time.time() - t0,
                            cmdline(pid), "", "the environment's code, before specli audit "
                            "re-executed itself", "killed", "auditor"))
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for _ in out:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, os.WNOHANG)
    return out


def isolation_probe() -> tuple[str, str]:
    """(how the run would be isolated, "") or ("", why a new network namespace is not
    permitted here): tried in a forked child (this process keeps its namespace)."""
    from specli.audit._site import boot

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.write(w, json.dumps(boot.isolate()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        raw = f.read().decode()
    os.waitpid(pid, 0)
    try:
        how, why = json.loads(raw)
    except ValueError:
        return "", "the probe for a network namespace ended abnormally"
    return how, why


def isolation_refused() -> str | None:
    """Why a new network namespace is not permitted here, or None."""
    return isolation_probe()[1] or None
