"""Observing and blocking network use: what `specli audit` (and its tests) rely on.

Three layers, each covering what the others cannot:

- the recorder (specli/_audit_site): a `sys.addaudithook` hook in this process and, through
  PYTHONPATH, in Python children. It sees every connect, bind, sendto, DNS lookup and process
  start made from Python, failed ones included, and who made it; not what C code does.
- a /proc poller: the sockets this process and all its descendants hold, read from
  /proc/PID/fd and /proc/PID/net/* every `interval`. It sees C code (llama.cpp) and children
  that are not Python; a socket opened and closed between two polls slips through.
- `isolate()`: a new network namespace whose only interface is a downed loopback, so any
  attempt, by anyone, fails by construction (ENETUNREACH).

Nothing here prints; the CLI reports. Linux only (/proc, namespaces).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import ipaddress
import json
import os
import re
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from specli._audit_site import sitecustomize as recorder
from specli.errors import SpecliError

SITE_DIR = str(Path(recorder.__file__).parent)

EXTERNAL, LOOPBACK, LOCAL, PROCESS = "external", "loopback", "local", "process"
_AF_UNIX, _AF_NETLINK = 1, 16
_TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
               6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN",
               11: "CLOSING", 12: "NEW_SYN_RECV"}
_INET_TABLES = ("tcp", "tcp6", "udp", "udp6", "udplite", "udplite6", "raw", "raw6", "icmp",
                "icmp6")
# environment variables that can make a run use the network, or say how it would
_ENV = re.compile(r"^(HF_|HUGGINGFACE_|HUGGING_FACE_|SPECLI_)|_PROXY$|^(SSL_CERT_FILE|SSL_CERT_DIR|"
                  r"REQUESTS_CA_BUNDLE|CURL_CA_BUNDLE)$", re.IGNORECASE)
_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)


class AuditError(SpecliError):
    """The audit itself could not run (exit 2): no /proc, isolation not permitted."""


@dataclass
class NetEvent:
    """One network use, or one process start, seen during an audit."""

    event: str  # the audit event (socket.connect, ...) or "socket" for one seen in /proc
    scope: str  # external | loopback | local | process
    pid: int
    t: float  # seconds since the audit began
    address: str = ""  # host:port, a path, a URL, or a command line
    proto: str = ""  # tcp, udp6, unix, ... where known
    where: str = ""  # who: file:line in function (hook), the process's command line (/proc)
    outcome: str | None = None  # ok, ENETUNREACH, ... (hook); the socket's state (/proc)
    source: str = "hook"  # hook | proc
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


def _address(rec: dict) -> tuple[str, str]:
    """(scope, address as text) of one recorder line."""
    event, addr = rec["event"], rec.get("address")
    family = rec.get("family")
    if family in (_AF_UNIX, _AF_NETLINK):
        return LOCAL, _text(addr)
    if family is not None:  # a socket method with an (host, port, ...) address
        host = addr[0] if isinstance(addr, list) and addr else None
        if event == "socket.sendmsg" and addr is None:
            return LOCAL, "(connected socket)"
        return host_scope(host, listening=event == "socket.bind"), _hostport(addr)
    if event in ("urllib.Request", "webbrowser.open"):
        url = addr[0] if isinstance(addr, list) and addr else str(addr)
        return host_scope(urlsplit(str(url)).hostname or ""), str(url)
    host = addr[0] if isinstance(addr, list) and addr else addr
    if isinstance(host, list):  # getnameinfo's sockaddr
        return host_scope(host[0] if host else None), _hostport(host)
    return host_scope(None if host is None else str(host)), _hostport(addr)


def _hostport(addr) -> str:
    if isinstance(addr, list) and len(addr) >= 2 and isinstance(addr[1], (int, str)):
        host = str(addr[0])
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    if isinstance(addr, list) and len(addr) == 1:
        return str(addr[0])
    return _text(addr)


def _text(v) -> str:
    return "" if v is None else (v if isinstance(v, str) else json.dumps(v))


# --- /proc ----------------------------------------------------------------------------------

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
            out[int(f[9])] = (proto, _join(lh, lp), _join(rh, rp), state)
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


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split(hostport: str) -> str:
    return hostport.rsplit(":", 1)[0].strip("[]")


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


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()[:200]


class ProcPoller:
    """The sockets a process tree holds, polled; each (pid, socket, peer) is reported once."""

    def __init__(self, pid: int, t0: float):
        if not os.path.isdir(f"/proc/{pid}/fd"):
            raise AuditError("/proc is not available: the socket poll cannot run",
                             hint="specli audit needs Linux with /proc mounted")
        if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
            raise AuditError("this kernel has no /proc/PID/task/TID/children "
                             "(CONFIG_PROC_CHILDREN): child processes cannot be followed")
        self.pid, self.t0 = pid, t0
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
            inodes = _socket_inodes(pid)
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
            scope, address = host_scope(_split(remote)), remote
        elif state == "LISTEN":  # reachable from wherever it listens
            scope, address = host_scope(_split(local), listening=True), f"{local} (listening)"
        else:  # no peer: a datagram socket (auto-bound to 0.0.0.0 by its first sendto, whose
            # destination the hook records) or a bound TCP socket not yet connected
            scope, address = LOCAL, f"{local} (bound, no peer)"
        return NetEvent("socket", scope, pid, time.time() - self.t0, address, proto,
                        _cmdline(pid), state or None, "proc",
                        inherited=inode in self._inherited)


# --- the guard ------------------------------------------------------------------------------

@dataclass
class Guard:
    """Records network use between `with Guard():` and its end: the recorder in this process
    and its Python children, and a /proc poll of the whole process tree."""

    interval: float = 0.02
    events: list[NetEvent] = field(default_factory=list)
    polls: int = 0
    seconds: float = 0.0

    def __enter__(self) -> Guard:
        self._t0 = time.time()
        self._poller = ProcPoller(os.getpid(), self._t0)
        self._failed: BaseException | None = None
        _subreaper()
        fd, self._log = tempfile.mkstemp(prefix="specli-audit-", suffix=".jsonl")
        os.close(fd)
        self._env = {k: os.environ.get(k) for k in (recorder.LOG_ENV, "PYTHONPATH")}
        os.environ[recorder.LOG_ENV] = self._log
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (SITE_DIR, os.environ.get("PYTHONPATH")) if p)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="specli-audit-poll",
                                        daemon=True)
        try:
            self._poller.baseline()
            recorder.install(self._log)
            self._thread.start()
        except BaseException:
            self._close()
            raise
        return self

    def _poll(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self._poller.poll()
        except BaseException as e:  # noqa: BLE001 - reported by __exit__: the audit failed
            self._failed = e

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._poller.poll()  # a last look, after the run
            self.events = sorted(self._recorded() + self._poller.events, key=lambda e: e.t)
        finally:
            self._close()
        self.seconds = time.time() - self._t0
        self.polls = self._poller.polls
        if self._failed is not None and exc[0] is None:
            raise AuditError(f"the /proc poll failed: {self._failed!r}")

    def _close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        recorder.uninstall()
        for k, v in self._env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if os.path.exists(self._log):
            os.unlink(self._log)

    def _recorded(self) -> list[NetEvent]:
        """The recorder's lines (this process and its Python children) as events."""
        recs, outcomes = [], {}
        with open(self._log, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a child killed mid-write: its last line
                if "ref" in rec:
                    outcomes[rec["ref"]] = rec.get("outcome")
                elif "event" in rec:
                    recs.append(rec)
        out = []
        for rec in recs:
            if rec["event"] in recorder.PROCESS:
                cmd = rec.get("command")
                scope = PROCESS
                address = shlex.join(map(str, cmd)) if isinstance(cmd, list) else _text(cmd)
            else:
                scope, address = _address(rec)
            proto = {1: "unix", 2: "inet", 10: "inet6", 16: "netlink"}.get(rec.get("family"), "")
            if proto.startswith("inet"):
                proto += {1: "/tcp", 2: "/udp"}.get(rec.get("type", 0) & 0xF, "")
            out.append(NetEvent(rec["event"], scope, rec["pid"], rec["t"] - self._t0, address,
                                proto, rec.get("where", ""), outcomes.get(rec.get("id"))))
        return out


def _subreaper() -> None:
    """Adopt orphaned descendants (a daemon's double fork), so the /proc walk still finds
    them below this process; best effort (prctl PR_SET_CHILD_SUBREAPER, Linux 3.4+)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def verdict(events: list[NetEvent], strict: bool = False) -> tuple[int, list[NetEvent]]:
    """(exit code, the events that decided it): 1 if anything left, or tried to leave, the
    machine; with `strict`, loopback, local sockets and process starts count too."""
    counted = {EXTERNAL} | ({LOOPBACK, LOCAL, PROCESS} if strict else set())
    bad = [e for e in events if e.scope in counted and not e.inherited]
    return (1 if bad else 0), bad


def to_dict(e: NetEvent) -> dict:
    return asdict(e)


# --- what was loaded, and the environment ---------------------------------------------------

def file_sha256(path: str, progress: Callable[[int], None] | None = None,
                chunk: int = 8 << 20) -> str:
    """The file's sha256, read in chunks; `progress(n)` after each chunk of n bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if progress:
                progress(len(block))
    return h.hexdigest()


def network_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that can turn on (or describe) network use: HF_*, HUGGINGFACE_*,
    HUGGING_FACE_*, SPECLI_*, proxies and CA bundles; secrets and proxy passwords redacted."""
    env = os.environ if environ is None else environ
    out = {}
    for k in sorted(env):
        if not _ENV.search(k) or k in (recorder.LOG_ENV, ISOLATED_ENV):
            continue
        v = env[k]
        if _SECRET.search(k) and v:
            v = "(set, redacted)"
        elif "@" in v:  # a proxy URL's user:password (or a token as the user name)
            v = re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)?.*@", r"\1***@", v)  # to the last @
        out[k] = v
    return out


# --- isolation ------------------------------------------------------------------------------

CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000


def _unshare(flags: int) -> int:
    """0, or the errno of unshare(2) (os.unshare is Python 3.12+)."""
    if hasattr(os, "unshare"):
        try:
            os.unshare(flags)
        except OSError as e:
            return e.errno or errno.EPERM
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.unshare(flags) == 0 else ctypes.get_errno()


ISOLATED_ENV = "SPECLI_AUDIT_ISOLATED"


def enter_namespace() -> str:
    """Move this process into a new network namespace, so that everything it and its children
    do from now on has no way out; returns how. Only a single-threaded process can (a thread
    keeps its namespace, and a user namespace needs it): hence `isolated_command`, which
    re-executes a command through this, first thing. AuditError if not permitted."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise AuditError(f"cannot isolate: this process already runs {threads} threads, "
                         "which would keep the old network namespace")
    e1 = _unshare(CLONE_NEWNET)
    if not e1:
        return "network namespace"
    e2 = _unshare(CLONE_NEWUSER | CLONE_NEWNET)
    if not e2:
        return "user and network namespaces"
    raise AuditError(
        f"network isolation is not permitted here: unshare(CLONE_NEWNET): {os.strerror(e1)}; "
        f"with a new user namespace: {os.strerror(e2)}",
        hint="run as root, or allow unprivileged user namespaces "
             "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces)")


def isolated_command() -> list[str]:
    """This process's own command line, re-executed in a new network namespace. AuditError
    when this process is not its own command (the audit called from another program)."""
    args = sys.argv[1:]
    if not args or sys.orig_argv[len(sys.orig_argv) - len(args):] != args:
        raise AuditError("--isolate re-executes the command line, and this process was not "
                         "started as `specli audit ...`")
    return [sys.executable, "-m", "specli.netguard", sys.executable, *sys.orig_argv[1:]]


def isolation() -> dict | None:
    """How this process was isolated (None: it was not), after checking that its network
    namespace has no interface but a loopback: the claim is checked, not trusted."""
    how = os.environ.get(ISOLATED_ENV)
    if not how:
        return None
    found = interfaces()
    if any(not i.startswith("lo ") for i in found):
        raise AuditError(f"not isolated: this network namespace has {', '.join(found)}")
    return {"how": how, "interfaces": found, "netns": os.readlink("/proc/self/ns/net")}


def interfaces() -> list[str]:
    """This process's network namespace's interfaces, each with `up` or `down` (from
    /proc/self/net/dev: /sys/class/net shows the namespace sysfs was mounted in)."""
    import fcntl
    import socket
    import struct

    names = [line.split(":")[0].strip()
             for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]]
    out = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        for name in sorted(names):
            try:
                req = struct.pack("16sH", name.encode()[:15], 0)
                flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, req)[:18])[1]
            except OSError:
                flags = 0
            out.append(f"{name} ({'up' if flags & 1 else 'down'})")
    return out


def _bootstrap(argv: list[str]) -> None:
    """python -m specli.netguard PROGRAM ARGS...: PROGRAM in a new network namespace."""
    try:
        how = enter_namespace()
    except AuditError as e:
        sys.stderr.write(f"error: {e.message}" + (f" (hint: {e.hint})" if e.hint else "") + "\n")
        sys.exit(e.exit_code)
    os.environ[ISOLATED_ENV] = how
    os.execv(argv[0], argv)


if __name__ == "__main__":
    _bootstrap(sys.argv[1:])
