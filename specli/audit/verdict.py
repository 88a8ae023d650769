"""The verdict: the layers' events merged into one account, and whether it proves the run
made no network connection.
"""

from __future__ import annotations

from dataclasses import asdict

from specli.audit.events import (
    EXTERNAL,
    LOCAL,
    LOOPBACK,
    OUTLIVED,
    PROCESS,
    NetEvent,
    host_of,
    host_scope,
)

_PAIRS = {"connect": "socket.connect", "sendto": "socket.sendto", "sendmsg": "socket.sendmsg"}


def merge(hooked: list[NetEvent], syscalls: list[NetEvent]) -> list[NetEvent]:
    """One event per call: a syscall the hook also saw (same process, call, address) adds
    "seccomp" to the hook's event, which knows the Python caller and the outcome."""
    free = {}
    for e in hooked:
        free.setdefault((e.pid, e.event, e.address), []).append(e)
    out = list(hooked)
    for s in syscalls:
        match = free.get((s.pid, _PAIRS.get(s.event, ""), s.address.removesuffix(" (DNS)")))
        if match:
            e = match.pop(0)
            e.source = "hook+seccomp"
            if s.scope == EXTERNAL:
                e.scope = EXTERNAL
            if (s.outcome or "").startswith("refused"):  # the auditor's answer, isolated
                e.outcome = s.outcome
        else:
            out.append(s)
    return out


def unpeered(events: list[NetEvent]) -> list[NetEvent]:
    """A datagram socket with no peer, seen in /proc, sent to destinations /proc cannot show:
    local only when every addressed send of that process was seen going to loopback or a
    local socket; otherwise external (destination unknown)."""
    sends: dict[int, list[str]] = {}
    for e in events:
        if e.source != "proc" and e.event in ("socket.sendto", "socket.sendmsg", "sendto",
                                              "sendmsg", "sendmmsg"):
            sends.setdefault(e.pid, []).append(e.scope)
    for e in events:
        if e.source == "proc" and e.proto.startswith("udp") and e.outcome == "unconnected" \
                and not e.inherited and host_scope(host_of(e.address.split(" (")[0])) != LOOPBACK:
            seen = sends.get(e.pid)
            if seen and all(s in (LOOPBACK, LOCAL) for s in seen):
                e.scope = LOCAL
            else:
                e.scope = EXTERNAL
                e.address = e.address.replace("(bound, no peer)", "(no peer: destination "
                                              "unknown)")
    return events


def verdict(events: list[NetEvent], strict: bool = False) -> tuple[int, list[NetEvent]]:
    """(exit code, the events that decided it): 1 if anything left, or tried to leave, the
    machine, or a process outlived the run; with `strict`, loopback, local sockets and process
    starts count too."""
    counted = {EXTERNAL, OUTLIVED} | ({LOOPBACK, LOCAL, PROCESS} if strict else set())
    bad = [e for e in events if e.scope in counted and not e.inherited]
    return (1 if bad else 0), bad


def to_dict(e: NetEvent) -> dict:
    return asdict(e)
