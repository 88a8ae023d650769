"""What the audit records: a network event, its scope, and the address text every layer
writes the same way.
"""

from __future__ import annotations

import ipaddress
import sys
from dataclasses import dataclass

from specli.errors import SpecliError

EXTERNAL, LOOPBACK, LOCAL, PROCESS = "external", "loopback", "local", "process"
OUTLIVED = "outlived"  # a process of the tree still running after the run: killed, counted
RESULT_ENV = "SPECLI_AUDIT_RESULT"
AF_UNIX, AF_NETLINK = 1, 16
AF_INET, AF_INET6, AF_UNSPEC = 2, 10, 0


class AuditError(SpecliError):
    """The audit itself could not run (exit 2): no /proc, isolation not permitted."""


@dataclass
class NetEvent:
    """One network use, or one process start, seen during an audit."""

    event: str  # the audit event (socket.connect, ...) or "socket" for one seen in /proc
    scope: str  # external | loopback | local | process | outlived
    pid: int
    t: float  # seconds since the audit began
    address: str = ""  # host:port, a path, a URL, or a command line
    proto: str = ""  # tcp, udp6, unix, ... where known
    where: str = ""  # who: file:line in function (hook), the process's command line (/proc)
    outcome: str | None = None  # ok, ENETUNREACH, ... (hook); the socket's state (/proc)
    source: str = "hook"  # hook | seccomp | hook+seccomp | proc | auditor
    inherited: bool = False  # held before the audit began: listed, not counted


def host_scope(host: str | None, listening: bool = False) -> str:
    """Where a name or address leads: loopback, or external (a DNS lookup may leave the
    machine). An unspecified address is external only for a listener (every interface)."""
    if host is None or host == "":
        return EXTERNAL if listening else LOCAL
    name = host.strip("[]").split("%")[0].lower()
    if name == "localhost":  # resolved locally (RFC 6761); any other name may reach a resolver
        return LOOPBACK
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return EXTERNAL
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return LOOPBACK
    return EXTERNAL


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def host_of(hostport: str) -> str:
    return hostport.rsplit(":", 1)[0].strip("[]")


def sockaddr(raw: bytes, connect: bool = True) -> tuple[str, str, str] | None:
    """(scope, address, proto) of a struct sockaddr as a syscall passed it; None for a
    connect to AF_UNSPEC (a disconnect). A send to AF_UNSPEC goes where an AF_INET address
    would (the kernel reads it so for IPv4 datagram and raw sockets)."""
    if len(raw) < 2:
        return EXTERNAL, f"unreadable address ({len(raw)} bytes)", ""
    family = int.from_bytes(raw[:2], sys.byteorder)
    if family == AF_UNSPEC:
        if connect:
            return None
        family = AF_INET
    if family == AF_UNIX:
        path = raw[2:]
        text = ("@" + path[1:].split(b"\0")[0].decode("utf-8", "replace") if path[:1] == b"\0"
                else path.split(b"\0")[0].decode("utf-8", "replace"))
        return LOCAL, text or "(unnamed)", "unix"
    if family == AF_NETLINK:
        return LOCAL, "netlink", "netlink"
    if family in (AF_INET, AF_INET6) and len(raw) >= (8 if family == AF_INET else 24):
        port = int.from_bytes(raw[2:4], "big")
        host = str(ipaddress.ip_address(raw[4:8] if family == AF_INET else raw[8:24]))
        proto = "inet" if family == AF_INET else "inet6"
        if port == 53:  # a resolver, wherever it listens, answers from outside
            return EXTERNAL, f"{hostport(host, port)} (DNS)", proto
        return host_scope(host), hostport(host, port), proto
    return EXTERNAL, f"address family {family}", f"family {family}"
