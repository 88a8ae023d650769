"""The /proc poller: the sockets a process tree holds, read from /proc/PID/fd and
/proc/PID/net/* at an interval: listeners, and a cross-check of the other layers.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import time
from pathlib import Path

from specli.audit.events import EXTERNAL, LOCAL, AuditError, NetEvent, host_of, host_scope, hostport

_TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
               6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN",
               11: "CLOSING", 12: "NEW_SYN_RECV"}


_INET_TABLES = ("tcp", "tcp6", "udp", "udp6", "udplite", "udplite6", "raw", "raw6", "icmp",
                "icmp6")


def _hex_addr(s: str) -> tuple[str, int]:
    """An address of /proc/net/tcp{,6}: hex host words in host byte order, then the port."""
    h, p = s.split(":")
    raw = bytes.fromhex(h)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    words = raw
    return str(ipaddress.ip_address(words)), int(p, 16)


def _read_tables(pid: int) -> dict[int, tuple[str, str, str, str]]:
    """inode -> (proto, local, remote, state) for the sockets of pid's network namespace."""
    out: dict[int, tuple[str, str, str, str]] = {}
    for proto in _INET_TABLES:
        try:
            lines = Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10:
                continue
            (lh, lp), (rh, rp) = _hex_addr(f[1]), _hex_addr(f[2])
            st = int(f[3], 16)
            state = _TCP_STATES.get(st, str(st)) if proto.startswith("tcp") else \
                ("connected" if st == 1 else "unconnected")
            out[int(f[9])] = (proto, hostport(lh, lp), hostport(rh, rp), state)
    try:
        for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
            f = line.split()
            if len(f) >= 7:
                out[int(f[6])] = ("unix", f[7] if len(f) > 7 else "", "", "")
    except OSError:
        pass
    try:  # raw link-layer sockets: they can send anything anywhere
        for line in Path(f"/proc/{pid}/net/packet").read_text().splitlines()[1:]:
            f = line.split()
            if len(f) >= 9:
                out[int(f[8])] = ("packet", f"interface {f[4]}", "", "")
    except OSError:
        pass
    return out


def descendants(pid: int) -> list[int]:
    """pid and every process below it (children of any of its threads), from /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                todo += [int(c) for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
            except (OSError, ValueError):
                pass
    return out


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()[:200]


class ProcPoller:
    """The sockets a process tree holds, polled; each (pid, socket, peer) is reported once."""

    def __init__(self, pid: int, t0: float, skip: int | None = None):
        if not os.path.isdir(f"/proc/{pid}/fd"):
            raise AuditError("/proc is not available: the socket poll cannot run",
                             hint="specli audit needs Linux with /proc mounted")
        if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
            raise AuditError("this kernel has no /proc/PID/task/TID/children "
                             "(CONFIG_PROC_CHILDREN): child processes cannot be followed")
        self.pid, self.t0, self.skip = pid, t0, skip
        self.events: list[NetEvent] = []
        self.polls = 0
        self._seen: set[tuple] = set()
        self._inherited: set[int] = set()  # socket inodes (a child inherits its parent's)

    def baseline(self) -> None:
        """Sockets held before the audit began (a terminal, a log collector): not counted."""
        for pid in descendants(self.pid):
            self._inherited |= _socket_inodes(pid)
        self.poll()

    def poll(self) -> None:
        self.polls += 1
        tables: dict[str, dict] = {}  # per network namespace
        for pid in descendants(self.pid):
            inodes = _socket_inodes(pid) if pid != self.skip else set()
            if not inodes:
                continue
            try:
                ns = os.readlink(f"/proc/{pid}/ns/net")
            except OSError:
                ns = str(pid)
            for inode in inodes:
                if ns not in tables or inode not in tables[ns]:
                    tables[ns] = _read_tables(pid)
                proto, local, remote, state = tables[ns].get(inode, ("", "", "", ""))
                key = (pid, inode, remote, state == "LISTEN")
                if key in self._seen:
                    continue
                self._seen.add(key)
                self.events.append(self._event(pid, inode, proto, local, remote, state))

    def _event(self, pid, inode, proto, local, remote, state) -> NetEvent:
        if proto == "unix" or not proto:
            scope, address = LOCAL, local or f"socket inode {inode}"
            proto = proto or "socket (unbound, or not inet/unix)"
        elif proto == "packet":
            scope, address = EXTERNAL, local
        elif remote and not remote.startswith(("0.0.0.0:0", "[::]:0")):
            scope, address = host_scope(host_of(remote)), remote
        elif state == "LISTEN":  # reachable from wherever it listens
            scope, address = host_scope(host_of(local), listening=True), f"{local} (listening)"
        else:  # no peer: a datagram socket (auto-bound to 0.0.0.0 by its first sendto, whose
            # destination the hook records) or a bound TCP socket not yet connected
            scope, address = LOCAL, f"{local} (bound, no peer)"
        return NetEvent("socket", scope, pid, time.time() - self.t0, address, proto,
                        cmdline(pid), state or None, "proc",
                        inherited=inode in self._inherited)
