"""Observing and blocking network use: what `specli audit` (and its tests) rely on.

Two processes: the auditor (`Auditor`, in `specli audit`) and the audited (`python -I -S
specli/_audit_site/boot.py`, which runs the generation). Four layers, each covering what the
others cannot:

- isolation: the audited process moves into a new network namespace whose only interface is a
  downed loopback before anything else runs in it, so any attempt, by anyone in its tree,
  fails by construction (ENETUNREACH). This is what makes a clean verdict a proof.
- the seccomp listener (`Supervisor`): every connect, addressed sendto, sendmsg and sendmmsg of
  the tree, C code and raw syscalls included, waits in the auditor until its destination is
  recorded. Isolated or not, this is what reports what was tried.
- the recorder (specli/_audit_site): a `sys.addaudithook` hook in the audited process (before
  site) and, through PYTHONPATH, in Python children: who in Python made a call, DNS lookups
  through Python, process starts, and how each call ended.
- a /proc poller: the sockets the tree holds, read from /proc/PID/fd and /proc/PID/net/*
  every `interval`: listeners, and a cross-check of the other layers.

Nothing here prints; the CLI reports. Linux only (/proc, namespaces, seccomp).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import ipaddress
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from specli._audit_site import sitecustomize as recorder
from specli.errors import SpecliError

SITE_DIR = str(Path(recorder.__file__).parent)

EXTERNAL, LOOPBACK, LOCAL, PROCESS = "external", "loopback", "local", "process"
OUTLIVED = "outlived"  # a process of the tree still running after the run: killed, counted
RESULT_ENV = "SPECLI_AUDIT_RESULT"
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
            scope, address = host_scope(_split(remote)), remote
        elif state == "LISTEN":  # reachable from wherever it listens
            scope, address = host_scope(_split(local), listening=True), f"{local} (listening)"
        else:  # no peer: a datagram socket (auto-bound to 0.0.0.0 by its first sendto, whose
            # destination the hook records) or a bound TCP socket not yet connected
            scope, address = LOCAL, f"{local} (bound, no peer)"
        return NetEvent("socket", scope, pid, time.time() - self.t0, address, proto,
                        _cmdline(pid), state or None, "proc",
                        inherited=inode in self._inherited)


# --- the auditor ----------------------------------------------------------------------------

SECCOMP_CONTINUE = 1  # SECCOMP_USER_NOTIF_FLAG_CONTINUE: the call goes on as if not watched
_AF_INET, _AF_INET6, _AF_UNSPEC = 2, 10, 0
_SYSCALLS: dict[tuple[int, int], str] = {}
# devices a new network namespace gets when their modules are loaded: down, no address
_FALLBACK_DEVICES = {"sit0", "tunl0", "ip6tnl0", "ip6gre0", "gre0", "gretap0", "erspan0",
                     "ip_vti0", "ip6_vti0", "ip6erspan0"}


def _subreaper() -> None:
    """Adopt orphaned descendants (a daemon's double fork), so that the /proc walk still finds
    them below this process and the auditor can wait for them (PR_SET_CHILD_SUBREAPER)."""
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:
        raise AuditError("cannot become a child subreaper (prctl PR_SET_CHILD_SUBREAPER): "
                         "daemons of the audited run could not be followed")


class _SeccompData(ctypes.Structure):
    _fields_ = [("nr", ctypes.c_int), ("arch", ctypes.c_uint32),
                ("instruction_pointer", ctypes.c_uint64), ("args", ctypes.c_uint64 * 6)]


class _Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("data", _SeccompData)]


class _NotifResp(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


def _pidfd_getfd(pid: int, fd: int, thread: bool = False) -> int:
    """A copy of another process's descriptor (pidfd_getfd(2), Linux 5.6+; a parent may);
    `thread`: pid is a thread's id, whose own table is read (PIDFD_THREAD, Linux 6.9+; the
    process's where the kernel is older)."""
    pidfd = None
    if thread:
        try:
            pidfd = os.pidfd_open(pid, os.O_EXCL)  # PIDFD_THREAD
        except OSError:
            pid = _tgid(pid)
    if pidfd is None:
        pidfd = os.pidfd_open(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        got = libc.syscall(438, pidfd, fd, 0)  # SYS_pidfd_getfd (the same on every arch)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"pidfd_getfd: {os.strerror(e)}")
        return got
    finally:
        os.close(pidfd)


def _tgid(tid: int) -> int:
    try:
        for line in Path(f"/proc/{tid}/status").read_text().splitlines():
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return tid


def _read_mem(tid: int, addr: int, n: int) -> bytes:
    fd = os.open(f"/proc/{tid}/mem", os.O_RDONLY)
    try:
        return os.pread(fd, n, addr)
    finally:
        os.close(fd)


def sockaddr(raw: bytes, connect: bool = True) -> tuple[str, str, str] | None:
    """(scope, address, proto) of a struct sockaddr as a syscall passed it; None for a
    connect to AF_UNSPEC (a disconnect). A send to AF_UNSPEC goes where an AF_INET address
    would (the kernel reads it so for IPv4 datagram and raw sockets)."""
    if len(raw) < 2:
        return EXTERNAL, f"unreadable address ({len(raw)} bytes)", ""
    family = int.from_bytes(raw[:2], sys.byteorder)
    if family == _AF_UNSPEC:
        if connect:
            return None
        family = _AF_INET
    if family == _AF_UNIX:
        path = raw[2:]
        text = ("@" + path[1:].split(b"\0")[0].decode("utf-8", "replace") if path[:1] == b"\0"
                else path.split(b"\0")[0].decode("utf-8", "replace"))
        return LOCAL, text or "(unnamed)", "unix"
    if family == _AF_NETLINK:
        return LOCAL, "netlink", "netlink"
    if family in (_AF_INET, _AF_INET6) and len(raw) >= (8 if family == _AF_INET else 24):
        port = int.from_bytes(raw[2:4], "big")
        host = str(ipaddress.ip_address(raw[4:8] if family == _AF_INET else raw[8:24]))
        proto = "inet" if family == _AF_INET else "inet6"
        if port == 53:  # a resolver, wherever it listens, answers from outside
            return EXTERNAL, f"{_join(host, port)} (DNS)", proto
        return host_scope(host), _join(host, port), proto
    return EXTERNAL, f"address family {family}", f"family {family}"


class Supervisor:
    """The auditor's end of the seccomp filter the audited process loaded (boot.py): every
    connect, bind, addressed sendto, sendmsg, sendmmsg and program start of the whole tree
    waits here until it is read from the caller's memory and recorded. Runs in the auditor,
    out of the tree's reach.

    Unisolated (an observation), a call then continues unchanged. Isolated (`emulate`), no
    network call continues: the auditor makes it itself, on its own copy of what it read, on
    the caller's socket (pidfd_getfd), and answers with the result. A destination rewritten
    by another thread after it was read (the known limit of seccomp user notification) is
    then never used, and what a network namespace does not scope is refused: unix sockets
    with a path (a daemon outside, docker.sock, a proxy), and families other than inet,
    inet6, netlink, packet and abstract unix (vsock reaches the host)."""

    def __init__(self, fd: int, t0: float, emulate: bool = False):
        from specli._audit_site import boot

        self.fd, self.t0, self.emulate = fd, t0, emulate
        self.events: list[NetEvent] = []
        self.calls = 0
        self.failed: BaseException | None = None
        self._lib = lib = boot.libseccomp()
        lib.seccomp_notify_alloc.argtypes = [ctypes.POINTER(ctypes.POINTER(_Notif)),
                                             ctypes.POINTER(ctypes.POINTER(_NotifResp))]
        lib.seccomp_notify_receive.argtypes = [ctypes.c_int, ctypes.POINTER(_Notif)]
        lib.seccomp_notify_respond.argtypes = [ctypes.c_int, ctypes.POINTER(_NotifResp)]
        lib.seccomp_notify_id_valid.argtypes = [ctypes.c_int, ctypes.c_uint64]
        lib.seccomp_notify_free.argtypes = [ctypes.POINTER(_Notif), ctypes.POINTER(_NotifResp)]
        lib.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p
        lib.seccomp_syscall_resolve_num_arch.argtypes = [ctypes.c_uint32, ctypes.c_int]
        self._req, self._resp = ctypes.POINTER(_Notif)(), ctypes.POINTER(_NotifResp)()
        if lib.seccomp_notify_alloc(ctypes.byref(self._req), ctypes.byref(self._resp)) < 0:
            os.close(fd)
            raise AuditError("seccomp_notify_alloc failed: the seccomp listener cannot run")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(32)
        self._calls: set[threading.Thread] = set()
        self._thread = threading.Thread(target=self._serve, name="specli-audit-seccomp",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()
        for t in list(self._calls):  # their events are part of what was seen
            t.join(2.0)
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        self._lib.seccomp_notify_free(self._req, self._resp)
        self._req = self._resp = None

    def _serve(self) -> None:
        import select

        lib, req, resp = self._lib, self._req, self._resp
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        misses = 0
        try:
            while True:
                ready = poller.poll(50)
                if not ready:
                    if self._stop.is_set():
                        return
                    continue
                if not ready[0][1] & select.POLLIN:  # hung up: no process uses the filter
                    return
                ctypes.memset(req, 0, ctypes.sizeof(_Notif))  # the kernel wants it zeroed
                if lib.seccomp_notify_receive(self.fd, req) < 0:
                    # the caller died before it was read (libseccomp: ECANCELED); anything
                    # that persists is a failure, not a reason to spin
                    misses += 1
                    if misses > 5000:
                        raise OSError("seccomp_notify_receive keeps failing")
                    time.sleep(0.001)
                    continue
                misses = 0
                n = req.contents
                nid, tid, nr, arch = n.id, n.pid, n.data.nr, n.data.arch
                args = list(n.data.args)
                name = self._name(nr, arch)
                if self.emulate and name in _EMULATED:  # answered by _emulate, on a thread
                    self.calls += 1      # of its own: a blocking call blocks only itself
                    # (at most 32 at once; a flood waits in the kernel, then gets EAGAIN)
                    if not self._slots.acquire(timeout=5.0):
                        self._respond(nid, 0, errno.EAGAIN)
                        continue
                    t = threading.Thread(target=self._emulate, args=(nid, tid, name, args),
                                         daemon=True, name="specli-audit-call")
                    self._calls.add(t)
                    t.start()
                    continue
                try:
                    found = self._describe(tid, nr, arch, args)
                    valid = lib.seccomp_notify_id_valid(self.fd, nid) == 0
                except Exception as e:  # noqa: BLE001 - the call is answered, and counted
                    found, valid = [NetEvent("syscall", EXTERNAL, _tgid(tid), time.time() -
                                             self.t0, f"undecodable ({e!r})"[:200], "", "",
                                             None, "seccomp")], True
                finally:
                    r = resp.contents
                    r.id, r.val, r.error, r.flags = nid, 0, 0, SECCOMP_CONTINUE
                    lib.seccomp_notify_respond(self.fd, resp)  # ENOENT: the caller is gone
                self.calls += 1
                if valid:
                    with self._lock:
                        self.events += found
        except BaseException as e:  # noqa: BLE001 - the auditor stops the run: no verdict
            self.failed = e

    def _respond(self, nid: int, val: int = 0, error: int = 0) -> None:
        resp = _NotifResp(nid, val, -error if error else 0, 0)
        with self._lock:  # never on a descriptor stop() closed (its number may be reused)
            if self.fd >= 0:
                self._lib.seccomp_notify_respond(self.fd, ctypes.byref(resp))  # ENOENT: gone

    def valid(self, nid: int) -> bool:
        """Whether the call `nid` still waits (its thread alive, not interrupted): checked
        after its memory and descriptors were read, which a recycled thread id would make
        another process's."""
        with self._lock:
            return self.fd >= 0 and self._lib.seccomp_notify_id_valid(self.fd, nid) == 0

    def _emulate(self, nid: int, tid: int, name: str, a: list[int]) -> None:
        """Make the caller's call here, on what was read once; answer with its result."""
        pid, t = _tgid(tid), time.time() - self.t0
        where = f"{_cmdline(pid)} (thread {tid})"
        events: list[NetEvent] = []
        val, err = -1, errno.EPERM
        try:
            val, err = _Call(self, nid, pid, tid, name, a, events, where, t).run()
        except _Gone:
            events.clear()  # the caller went away before its call was made: nothing done
        except Exception as e:  # noqa: BLE001 - refused, and counted
            events.append(NetEvent(name, EXTERNAL, pid, t, f"undecodable ({e!r})"[:200], "",
                                   where, "refused", "seccomp"))
            val, err = -1, errno.EPERM
        finally:
            try:
                self._respond(nid, val if err == 0 else 0, err)
            except Exception:  # noqa: BLE001 - the caller is gone
                pass
            with self._lock:
                self.events += events
            self._calls.discard(threading.current_thread())
            self._slots.release()

    def _name(self, nr: int, arch: int) -> str:
        if (nr, arch) not in _SYSCALLS:
            p = self._lib.seccomp_syscall_resolve_num_arch(arch, nr)
            _SYSCALLS[(nr, arch)] = ctypes.string_at(p).decode() if p else f"syscall {nr}"
        return _SYSCALLS[(nr, arch)]

    def _describe(self, tid: int, nr: int, arch: int, a: list[int]) -> list[NetEvent]:
        name = self._name(nr, arch)
        t = time.time() - self.t0
        pid = _tgid(tid)
        addrs: list[bytes] = []
        if name in ("execve", "execveat"):  # a program starts: recorded, then it goes on
            return [NetEvent(name, PROCESS, pid, t, _exec_line(tid, a, name == "execveat"),
                             "", f"{_cmdline(pid)} (thread {tid})", None, "seccomp")]
        if name == "bind":  # unisolated, a listener is seen by the /proc poll
            return []
        try:
            if name == "connect":
                addrs.append(_read_mem(tid, a[1], min(a[2], 128)))
            elif name == "sendto":
                addrs.append(_read_mem(tid, a[4], min(a[5], 128)))
            elif name in ("sendmsg", "sendmmsg"):
                count, stride = (1, 56) if name == "sendmsg" else (min(a[2], 1024), 64)
                block = _read_mem(tid, a[1], count * stride)
                for i in range(0, len(block) - 15, stride):
                    ptr = int.from_bytes(block[i:i + 8], sys.byteorder)
                    size = int.from_bytes(block[i + 8:i + 12], sys.byteorder)
                    if ptr:  # no name: a connected socket, whose connect was recorded
                        addrs.append(_read_mem(tid, ptr, min(size, 128)))
        except OSError as e:
            return [NetEvent(name, EXTERNAL, pid, t, f"unreadable destination ({e.strerror})",
                             "", f"{_cmdline(pid)} (thread {tid})", None, "seccomp")]
        out = []
        for raw in dict.fromkeys(addrs):
            found = sockaddr(raw, connect=name == "connect")
            if found is None:
                continue
            scope, address, proto = found
            out.append(NetEvent(name, scope, pid, t, address, proto,
                                f"{_cmdline(pid)} (thread {tid})", None, "seccomp"))
        return out


# -- the isolated audit's network calls, made by the auditor ------------------------------------

_EMULATED = ("connect", "bind", "sendto", "sendmsg", "sendmmsg")
_MAX_SEND = 1 << 20  # bytes one emulated send may carry (more: EMSGSIZE)
_AF_PACKET = 17
_SCOPED = {_AF_INET, _AF_INET6, _AF_NETLINK, _AF_PACKET, _AF_UNSPEC}  # by the namespace


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32),
                ("iov", ctypes.c_void_p), ("iovlen", ctypes.c_size_t),
                ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


_MMSG = ctypes.sizeof(_MsgHdr) + 8  # struct mmsghdr: the msghdr, msg_len, padding
_libc_net = ctypes.CDLL(None, use_errno=True)
for _f in ("connect", "bind", "sendto", "sendmsg"):
    getattr(_libc_net, _f).restype = ctypes.c_ssize_t if _f.startswith("send") else ctypes.c_int
_libc_net.connect.argtypes = _libc_net.bind.argtypes = [ctypes.c_int, ctypes.c_char_p,
                                                         ctypes.c_uint32]
_libc_net.sendto.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
                             ctypes.c_char_p, ctypes.c_uint32]
_libc_net.sendmsg.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]


class _Refused(Exception):
    def __init__(self, err: int):
        self.err = err


class _Gone(Exception):
    """The caller is no longer waiting: its call is not made."""


_MSG_DONTWAIT = 0x40


class _Call:
    """One network call of the isolated tree, made by the auditor: the destination read once
    (what a namespace does not scope refused), then the call made on a copy of the caller's
    socket with that copy of the destination."""

    def __init__(self, sup: Supervisor, nid: int, pid: int, tid: int, name: str,
                 a: list[int], events: list[NetEvent], where: str, t: float):
        self.sup, self.nid, self.pid, self.tid, self.name, self.a = sup, nid, pid, tid, name, a
        self.events, self.where, self.t = events, where, t

    def run(self) -> tuple[int, int]:
        """(return value, errno): the call's result, as the caller gets it."""
        try:
            return getattr(self, "_" + self.name)()
        except _Refused as e:
            return -1, e.err

    # -- reading the caller ---------------------------------------------------------------------
    def _read(self, ptr: int, n: int) -> bytes:
        if n == 0:
            return b""
        try:
            got = _read_mem(self.tid, ptr, n)
        except OSError:
            raise _Refused(errno.EFAULT) from None
        if len(got) != n:
            raise _Refused(errno.EFAULT)
        return got

    def _address(self, ptr: int, n: int) -> bytes:
        if n > 128 or n < 2:  # sizeof(struct sockaddr_storage), or no family: the kernel
            raise _Refused(errno.EINVAL)  # says the same
        return self._read(ptr, n)

    def _judge(self, raw: bytes, bind: bool = False) -> tuple[str, str, str] | None:
        """Refuse (_Refused, recorded) a destination the namespace does not scope; else its
        (scope, address, proto) for the record (None: nothing to record)."""
        family = int.from_bytes(raw[:2], sys.byteorder) if len(raw) >= 2 else -1
        if family == _AF_UNIX and len(raw) > 2 and raw[2:3] != b"\0":
            path = raw[2:].split(b"\0")[0].decode("utf-8", "replace")
            self._note(LOCAL, path, "unix", "refused: a unix socket path reaches processes "
                       "outside the namespace")
            raise _Refused(errno.EACCES)
        if family != _AF_UNIX and family not in _SCOPED:
            self._note(EXTERNAL, f"address family {family}", f"family {family}",
                       "refused: a family the namespace does not scope")
            raise _Refused(errno.EAFNOSUPPORT)
        if bind:
            return None
        return sockaddr(raw, connect=self.name == "connect")

    def _note(self, scope: str, address: str, proto: str, outcome: str | None) -> None:
        self.events.append(NetEvent(self.name, scope, self.pid, self.t, address, proto,
                                    self.where, outcome, "seccomp"))

    def _socket(self, fd: int) -> int:
        """A copy of the caller's descriptor (its thread's table: a thread may have its own),
        taken once the call is known to still wait."""
        try:
            got = _pidfd_getfd(self.tid, fd, thread=True)
        except OSError as e:
            raise _Refused(e.errno or errno.EBADF) from None
        if not self.sup.valid(self.nid):
            os.close(got)
            raise _Gone
        return got

    @staticmethod
    def _stream(dup: int) -> bool:
        import socket

        s = socket.socket(fileno=dup)
        try:
            return s.type == socket.SOCK_STREAM
        finally:
            s.detach()

    def _still(self) -> None:
        """Everything read from the caller: is it the same call still (not a recycled id)?"""
        if not self.sup.valid(self.nid):
            raise _Gone

    def _made(self, found, rc: int) -> tuple[int, int]:
        e = ctypes.get_errno() if rc < 0 else 0
        if found is not None:
            self._note(*found, "ok" if rc >= 0 else errno.errorcode.get(e, str(e)))
        return (rc, 0) if rc >= 0 else (-1, e)

    # -- the calls ------------------------------------------------------------------------------
    def _connect(self) -> tuple[int, int]:
        return self._addressed(_libc_net.connect)

    def _bind(self) -> tuple[int, int]:
        return self._addressed(_libc_net.bind, bind=True)

    def _addressed(self, call, bind: bool = False) -> tuple[int, int]:
        """connect or bind: (fd, address, its length)."""
        fd, ptr, n = self.a[0], self.a[1], self.a[2]
        raw = self._address(ptr, n)
        found = self._judge(raw, bind=bind)
        dup = self._socket(fd)
        try:
            self._still()
            return self._made(found, call(dup, raw, n))
        finally:
            os.close(dup)

    def _sendto(self) -> tuple[int, int]:
        fd, buf, length, flags, ptr, n = self.a[:6]
        raw = self._address(ptr, n)
        found = self._judge(raw)
        dup = self._socket(fd)
        try:
            if length > _MAX_SEND:  # a stream takes part of it, as the kernel would
                if not self._stream(dup):
                    raise _Refused(errno.EMSGSIZE)
                length = _MAX_SEND
            data = self._read(buf, length)
            self._still()
            # never blocking here: a full buffer is EAGAIN, not an auditor thread held
            return self._made(found, _libc_net.sendto(dup, data, length,
                                                      flags | _MSG_DONTWAIT, raw, n))
        finally:
            os.close(dup)

    def _message(self, dup: int, at: int, flags: int) -> tuple[int, int]:
        """One struct msghdr of the caller's, at `at`, sent on `dup`."""
        hdr = _MsgHdr.from_buffer_copy(self._read(at, ctypes.sizeof(_MsgHdr)))
        found, raw = None, b""
        if hdr.name and hdr.namelen:
            raw = self._address(hdr.name, hdr.namelen)
            found = self._judge(raw)
        if hdr.controllen:  # descriptors or credentials: no run of specli passes any
            self._note(LOCAL, "ancillary data (descriptors, credentials)", "", "refused")
            raise _Refused(errno.EPERM)
        if hdr.iovlen > 1024:  # UIO_MAXIOV
            raise _Refused(errno.EMSGSIZE)
        vecs = self._read(hdr.iov, hdr.iovlen * ctypes.sizeof(_IoVec)) if hdr.iovlen else b""
        parts, total = [], 0
        for i in range(hdr.iovlen):
            v = _IoVec.from_buffer_copy(vecs, i * ctypes.sizeof(_IoVec))
            n = min(v.len, _MAX_SEND - total)
            if n < v.len and not self._stream(dup):  # a stream takes part, as the kernel
                raise _Refused(errno.EMSGSIZE)        # would
            parts.append(self._read(v.base, n))
            total += n
            if total >= _MAX_SEND:
                break
        data = b"".join(parts)
        name_buf = ctypes.create_string_buffer(raw, len(raw)) if raw else None
        data_buf = ctypes.create_string_buffer(data, len(data))
        vec = _IoVec(ctypes.cast(data_buf, ctypes.c_void_p), len(data))
        mine = _MsgHdr(ctypes.cast(name_buf, ctypes.c_void_p) if raw else None, len(raw),
                       ctypes.cast(ctypes.pointer(vec), ctypes.c_void_p), 1, None, 0, 0)
        self._still()
        return self._made(found, _libc_net.sendmsg(dup, ctypes.byref(mine),
                                                   flags | _MSG_DONTWAIT))

    def _sendmsg(self) -> tuple[int, int]:
        fd, at, flags = self.a[0], self.a[1], self.a[2]
        dup = self._socket(fd)
        try:
            return self._message(dup, at, flags)
        finally:
            os.close(dup)

    def _sendmmsg(self) -> tuple[int, int]:
        fd, at, count, flags = self.a[0], self.a[1], min(self.a[2], 1024), self.a[3]
        dup = self._socket(fd)
        sent = 0
        try:
            for i in range(count):
                try:
                    n, e = self._message(dup, at + i * _MMSG, flags)
                except _Refused as r:
                    n, e = -1, r.err
                if n < 0:
                    return (sent, 0) if sent else (-1, e)
                _write_mem(self.tid, at + i * _MMSG + ctypes.sizeof(_MsgHdr),
                           n.to_bytes(4, sys.byteorder))
                sent += 1
            return sent, 0
        finally:
            os.close(dup)


def _write_mem(tid: int, addr: int, data: bytes) -> None:
    fd = os.open(f"/proc/{tid}/mem", os.O_WRONLY)
    try:
        os.pwrite(fd, data, addr)
    finally:
        os.close(fd)


def _string(tid: int, addr: int, limit: int = 4096) -> str:
    """A NUL-terminated string of the caller's, read a page at a time."""
    out = b""
    while addr and len(out) < limit:
        n = min(4096 - addr % 4096, limit - len(out))
        chunk = _read_mem(tid, addr, n)
        if b"\0" in chunk or not chunk:
            out += chunk.split(b"\0")[0]
            break
        out, addr = out + chunk, addr + n
    return out.decode("utf-8", "replace")


def _exec_line(tid: int, a: list[int], at: bool) -> str:
    """The program an execve (or execveat) starts, with its arguments."""
    path_ptr, argv_ptr = (a[1], a[2]) if at else (a[0], a[1])
    try:
        path = _string(tid, path_ptr)
        argv = []
        for i in range(64):
            p = int.from_bytes(_read_mem(tid, argv_ptr + 8 * i, 8), sys.byteorder) \
                if argv_ptr else 0
            if not p:
                break
            argv.append(_string(tid, p, 512))
    except OSError as e:
        return f"(unreadable: {e.strerror})"
    return shlex.join([path, *argv[1:]])


# -- what a proof rests on: no code of the environment, no socket handed in -------------------

def environment_code(environ: dict[str, str] | None = None) -> list[str]:
    """The environment's code that ran in this interpreter before specli did: sitecustomize
    and usercustomize (not the interpreter's own), `.pth` files with import lines that no
    installed distribution owns, and modules imported from PYTHONPATH (specli's own aside)."""
    import glob
    import site

    env = os.environ if environ is None else environ
    own = [os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, "/etc")]

    def under(path: str, roots) -> bool:
        real = os.path.realpath(path)
        return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)

    found = []
    for var in ("LD_PRELOAD", "LD_AUDIT"):  # the loader puts them in every process
        if env.get(var, "").strip():
            found.append(f"{var}={env[var]}")
    for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep):  # one that shadows the
        if d and glob.glob(os.path.join(d, "libseccomp.so*")):    # audit's own library
            found.append(f"libseccomp from LD_LIBRARY_PATH ({d})")
    for name in ("sitecustomize", "usercustomize"):
        f = getattr(sys.modules.get(name), "__file__", None)
        if f and not under(f, own):
            found.append(f"{name} ({f})")
    extra = {os.path.realpath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p}
    for name, m in list(sys.modules.items()):
        f = getattr(m, "__file__", None)
        if not f or "." in name or name in ("specli", "sitecustomize", "usercustomize"):
            continue
        # the folder a top-level module was found in: a package's parent, a module's own
        home = Path(f).parent.parent if Path(f).name.startswith("__init__.") else Path(f).parent
        if extra and os.path.realpath(home) in extra:
            found.append(f"module {name} from PYTHONPATH ({f})")
    dirs = list(site.getsitepackages()) + ([site.getusersitepackages()]
                                          if site.ENABLE_USER_SITE else [])
    owned = None
    for d in dirs:
        for pth in sorted(glob.glob(os.path.join(d, "*.pth"))):
            try:
                lines = Path(pth).read_text(errors="replace").splitlines()
            except OSError:
                continue
            if not any(line.startswith(("import ", "import\t")) for line in lines):
                continue
            if owned is None:
                owned = _owned_pth()
            if os.path.realpath(pth) not in owned:
                found.append(f".pth file that runs code, owned by no installed package ({pth})")
    return found


def _owned_pth() -> set[str]:
    from importlib import metadata

    out = set()
    for dist in metadata.distributions():
        listed = "".join(dist.read_text(name) or "" for name in ("RECORD", "installed-files.txt",
                                                                 "SOURCES.txt"))
        if ".pth" not in listed:  # most: their file list is not worth parsing (0.2 s for all)
            continue
        for f in dist.files or ():
            if str(f).endswith(".pth"):
                out.add(os.path.realpath(str(dist.locate_file(f))))
    return out


def isolate_self() -> None:
    """Move this process (the auditor, single-threaded yet) into a network namespace of its
    own, as the audited one will be: it needs no network for an isolated audit, so nothing
    that runs in it can reach one. AuditError if the kernel refuses."""
    from specli._audit_site import boot

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
                            _cmdline(pid), "", "the environment's code, before specli audit "
                            "re-executed itself", "killed", "auditor"))
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for _ in out:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, os.WNOHANG)
    return out


def standard_streams() -> list[NetEvent]:
    """Stdin, stdout and stderr that are sockets: the run writes (or reads) through them, to
    whoever is at the other end. An event each, scoped by that peer."""
    import socket
    import stat

    out = []
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with s:
            try:
                peer = s.getpeername()
            except OSError:
                peer = None
            family = s.family
        if family in (socket.AF_INET, socket.AF_INET6):
            proto = ("tcp" if s.type == socket.SOCK_STREAM else "udp") + \
                ("6" if family == socket.AF_INET6 else "")
            where = _join(str(peer[0]), peer[1]) if peer else "(no peer)"
            scope = host_scope(str(peer[0])) if peer else EXTERNAL
        elif family == socket.AF_UNIX:
            proto, scope = "unix", LOCAL
            where = (peer.decode("utf-8", "replace") if isinstance(peer, bytes) else peer) or \
                "(unnamed peer)"
        else:
            proto, scope, where = f"family {int(family)}", EXTERNAL, "(unknown peer)"
        out.append(NetEvent("inherited descriptor", scope, os.getpid(), 0.0,
                            f"{name}: {proto} socket to {where}", proto,
                            "handed to the run by whoever started specli audit", None,
                            "auditor"))
    return out


def isolation_probe() -> tuple[str, str]:
    """(how the run would be isolated, "") or ("", why a new network namespace is not
    permitted here): tried in a forked child (this process keeps its namespace)."""
    from specli._audit_site import boot

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


@dataclass
class Audit:
    """What the auditor saw of one audited run."""

    events: list[NetEvent]
    exit_code: int  # the audited process's
    seconds: float
    polls: int
    isolated: dict | None  # netns and interfaces, read by the auditor (not claimed)
    seccomp: str  # "" when active, else why not
    result: dict | None  # what the audited process wrote: models, run statistics

    @property
    def outlived(self) -> int:
        return sum(e.scope == OUTLIVED for e in self.events)


class Auditor:
    """Run `argv` (a specli command line) as the audited process, watched from its first
    instruction to the exit of the last process of its tree.

    The audited process is `python -I -S boot.py`: the recorder, the namespace and the seccomp
    filter come before anything else runs in it. This process stays outside: child subreaper
    (orphans and daemons are adopted), it polls /proc for the tree's sockets, serves the
    seccomp listener, and after the audited process exits waits `grace` seconds for the rest
    of the tree, then kills what outlives the run and reports it."""

    def __init__(self, argv: list[str], isolate: bool, interval: float = 0.02,
                 grace: float = 2.0, run_path: list[str] | None = None,
                 user_site: bool | None = None, landlock: bool = False):
        """run_path, user_site: the audited run's sys.path and user site (the user's own
        environment, PYTHONPATH included), where they differ from this process's."""
        self.argv, self.isolate, self.interval, self.grace = argv, isolate, interval, grace
        self.run_path, self.user_site, self.landlock = run_path, user_site, landlock

    def run(self) -> Audit:
        import site
        import subprocess

        from specli._audit_site import boot

        _subreaper()
        # nothing in the tree may ptrace this process (pidfd_getfd its listener, read its
        # memory): a process in another user namespace needs a capability it does not have
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
        me, t0 = os.getpid(), time.time()
        self._poll_failed: BaseException | None = None
        temps: list[str] = []
        fds: list[int] = []
        proc = supervisor = None
        seccomp, isolated = "", None
        stop = self._stop = threading.Event()
        thread = threading.Thread(target=self._poll, daemon=True, name="specli-audit-poll")
        events: list[NetEvent] = []
        outlived: list[NetEvent] = []
        try:
            for suffix in (".jsonl", ".json"):
                fd, path = tempfile.mkstemp(prefix="specli-audit-", suffix=suffix)
                os.close(fd)
                temps.append(path)
            log, result = temps
            status_r, status_w = os.pipe()
            go_r, go_w = os.pipe()
            fds += [status_r, status_w, go_r, go_w]
            cfg = {"status_fd": status_w, "go_fd": go_r, "isolate": self.isolate,
                   "auditor": me, "path": list(self.run_path or sys.path),
                   "user_site": bool(site.ENABLE_USER_SITE if self.user_site is None
                                     else self.user_site), "argv": self.argv,
                   "landlock": self.landlock}
            env = {**os.environ, recorder.LOG_ENV: log, RESULT_ENV: result,
                   boot.BOOT_ENV: json.dumps(cfg),
                   "PYTHONPATH": os.pathsep.join(p for p in (SITE_DIR,
                                                             os.environ.get("PYTHONPATH")) if p)}
            poller = ProcPoller(me, t0, skip=me)
            poller.baseline()
            self._poller = poller
            proc = subprocess.Popen([sys.executable, "-I", "-S", boot.__file__], env=env,
                                    pass_fds=(status_w, go_r))
            for d in (status_w, go_r):
                os.close(d)
                fds.remove(d)
            status = os.fdopen(status_r, "rb")
            fds.remove(status_r)
            with status:
                state = self._say(status, proc)
                try:  # can this process take the audited one's descriptors? (a filter
                    os.close(_pidfd_getfd(proc.pid, status_w))  # nobody serves would hang it)
                    os.write(go_w, b"y")
                    state = self._say(status, proc)
                except OSError as e:
                    seccomp = f"cannot take the audited process's descriptors ({e})"
                    os.write(go_w, b"n")
                if state.get("seccomp_fd") is not None:
                    try:
                        supervisor = Supervisor(
                            _pidfd_getfd(proc.pid, state["seccomp_fd"]), t0, self.isolate)
                    except OSError as e:  # it was possible a moment ago: no verdict
                        raise AuditError(f"cannot take the seccomp listener: {e}") from None
                elif not seccomp:
                    seccomp = state.get("seccomp_error") or "not loaded"
                if self.isolate:
                    isolated = self._check_isolated(proc.pid)
                if supervisor:
                    supervisor.start()
                thread.start()
                os.write(go_w, b"g")
            code = self._wait(proc, supervisor)
            outlived = self._outlive(me, t0, supervisor)
        except BaseException as e:
            for pid in descendants(me)[1:]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if proc is not None:
                with contextlib.suppress(ChildProcessError, OSError):
                    proc.wait()
            if isinstance(e, OSError):
                raise AuditError(f"the audit failed: {e}") from None
            raise
        finally:
            for d in fds:
                with contextlib.suppress(OSError):
                    os.close(d)
            stop.set()
            if thread.ident is not None:
                thread.join()
            if supervisor:
                supervisor.stop()
            if temps and os.path.exists(temps[0]):
                events = self._recorded(temps[0], t0)
            doc = None
            if len(temps) > 1:
                with contextlib.suppress(OSError, ValueError):
                    doc = json.loads(Path(temps[1]).read_text() or "null")
            for path in temps:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        poller.poll()
        events = _merge(events, supervisor.events if supervisor else [])
        events = sorted(_unpeered(events + poller.events) + outlived, key=lambda e: e.t)
        self._check_watch(supervisor)
        return Audit(events, code, time.time() - t0, poller.polls, isolated, seccomp,
                     doc if isinstance(doc, dict) else None)

    def _check_watch(self, supervisor: Supervisor | None) -> None:
        """A failed listener or poll means what happened was not all seen: no verdict."""
        for failed, what in ((supervisor.failed if supervisor else None, "seccomp listener"),
                             (self._poll_failed, "/proc poll")):
            if failed is not None:
                raise AuditError(f"the {what} failed: {failed!r}")

    @staticmethod
    def _say(status, proc) -> dict:
        """The audited process's next status line; AuditError if it refused or ended."""
        line = status.readline()
        try:
            state = json.loads(line) if line.strip() else {}
        except ValueError:
            state = {}
        if "error" in state:
            raise AuditError(str(state["error"]))
        if not isinstance(state, dict) or not state:
            raise AuditError(f"the audited process ended before it began (exit {proc.wait()})")
        return state

    def _poll(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self._poller.poll()
        except BaseException as e:  # noqa: BLE001 - reported by run(): the audit failed
            self._poll_failed = e

    @staticmethod
    def _check_isolated(pid: int) -> dict:
        """The audited process's namespace, read from here: its claim is not trusted. Only lo,
        or the fallback tunnel devices the kernel adds to every new namespace when their
        modules are loaded (down, addressless), and no route anywhere but on lo."""
        try:
            mine, theirs = os.readlink("/proc/self/ns/net"), os.readlink(f"/proc/{pid}/ns/net")
            names = sorted(line.split(":")[0].strip() for line in
                           Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:])
            v4 = Path(f"/proc/{pid}/net/route").read_text().splitlines()[1:]
            v6 = [line.split()[-1] for line in
                  Path(f"/proc/{pid}/net/ipv6_route").read_text().splitlines() if line.strip()]
        except OSError as e:
            raise AuditError(f"cannot read the audited process's network namespace: {e}") \
                from None
        extra = [n for n in names if n != "lo" and n not in _FALLBACK_DEVICES]
        if theirs == mine or extra or v4 or any(dev != "lo" for dev in v6):
            raise AuditError(f"not isolated: the audited process's network namespace {theirs} "
                             f"has {', '.join(names)}"
                             + (" and routes" if v4 or any(d != "lo" for d in v6) else ""))
        return {"netns": theirs, "interfaces": names}

    def _wait(self, proc, supervisor: Supervisor | None) -> int:
        """The audited process's exit code; orphans adopted meanwhile are reaped as they go. A
        failed listener or poll stops the run: no verdict."""
        while True:
            self._check_watch(supervisor)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                return proc.wait()
            if pid == proc.pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                return proc.returncode
            if pid == 0:
                time.sleep(0.01)

    def _outlive(self, me: int, t0: float, supervisor: Supervisor | None) -> list[NetEvent]:
        """Wait up to `grace` for the rest of the tree (atexit handlers finish, daemons run);
        then kill and report what is left."""
        deadline = time.monotonic() + self.grace
        out: list[NetEvent] = []
        while True:
            self._check_watch(supervisor)
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            rest = [p for p in descendants(me) if p != me and not _zombie(p)]
            if not rest:
                return out
            if time.monotonic() >= deadline:
                for pid in rest:
                    if pid not in {e.pid for e in out}:
                        out.append(NetEvent("outlived the run", OUTLIVED, pid, time.time() - t0,
                                            _cmdline(pid), "", f"killed after a {self.grace:g} s "
                                            "grace period", "killed", "auditor"))
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    @staticmethod
    def _recorded(log: str, t0: float) -> list[NetEvent]:
        """The recorder's lines (the audited process and its Python children) as events."""
        recs, outcomes = [], {}
        with open(log, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a child killed mid-write: its last line
                if not isinstance(rec, dict):
                    continue
                if "ref" in rec:
                    outcomes[rec["ref"]] = rec.get("outcome")
                elif "event" in rec and "pid" in rec and "t" in rec:
                    recs.append(rec)
        out = []
        for rec in recs:
            try:
                if rec["event"] in recorder.PROCESS:
                    cmd = rec.get("command")
                    scope = PROCESS
                    address = shlex.join(map(str, cmd)) if isinstance(cmd, list) else _text(cmd)
                else:
                    scope, address = _address(rec)
                proto = {1: "unix", 2: "inet", 10: "inet6", 16: "netlink"}.get(
                    rec.get("family"), "")
                if proto.startswith("inet"):
                    proto += {1: "/tcp", 2: "/udp"}.get(rec.get("type", 0) & 0xF, "")
                out.append(NetEvent(str(rec["event"]), scope, int(rec["pid"]),
                                    float(rec["t"]) - t0, address, proto,
                                    str(rec.get("where", "")), outcomes.get(rec.get("id"))))
            except (TypeError, ValueError, KeyError):  # a forged or broken line: kept, as is
                out.append(NetEvent("unreadable record", EXTERNAL, 0, 0.0, _text(rec)[:200],
                                    source="hook"))
        return out


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


_PAIRS = {"connect": "socket.connect", "sendto": "socket.sendto", "sendmsg": "socket.sendmsg"}


def _merge(hooked: list[NetEvent], syscalls: list[NetEvent]) -> list[NetEvent]:
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


def _unpeered(events: list[NetEvent]) -> list[NetEvent]:
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
                and not e.inherited and host_scope(_split(e.address.split(" (")[0])) != LOOPBACK:
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
        if not _ENV.search(k) or k in (recorder.LOG_ENV, RESULT_ENV, "SPECLI_AUDIT_ROLE",
                                       "SPECLI_AUDIT_AUDITOR"):
            continue
        v = env[k]
        if _SECRET.search(k) and v:
            v = "(set, redacted)"
        elif "@" in v:  # a proxy URL's user:password (or a token as the user name)
            v = re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)?.*@", r"\1***@", v)  # to the last @
        out[k] = v
    return out
