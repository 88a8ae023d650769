"""llama.cpp's RPC backend, the Python side: endpoints, reaching workers, and what happens
when one is lost. The ctypes calls (add a server, start one) live in backend/devices.py.

llama.cpp aborts the process when an RPC worker stops answering mid-call (GGML_ABORT:
"Remote RPC server crashed or returned malformed response"). backend/devices.py turns that
abort into a call to `lost()`, on whichever thread noticed; the handler decides what the
process does: a command prints one line naming the worker and exits 2 (the default), a server
fails its requests in flight and keeps answering 503 until the worker is back
(server/state.py).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence

from specli.errors import SpecliError, UsageError

DEFAULT_PORT = 50052  # rpc-server's
INSTALL = ('CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-cache-dir '
           'llama-cpp-python')
# llama.cpp's rpc-server, word for word: its protocol has no authentication
EXPOSED = """
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
WARNING: Host ('{host}') is != '127.0.0.1'
         Never expose the RPC server to an open network!
         This is an experimental feature and is not secure!
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
"""


class RpcUnavailable(SpecliError):
    """This llama-cpp-python was built without llama.cpp's RPC backend."""

    def __init__(self, what: str):
        super().__init__(f"{what} needs llama.cpp's RPC backend, and this llama-cpp-python "
                         "was built without it", hint=f"reinstall it with RPC: {INSTALL}")


class WorkerLost(SpecliError):
    """An RPC worker stopped answering: llama.cpp cannot go on with the model it held.
    unreachable: the workers named no longer accept connections (they may come back), as
    opposed to a worker that answers but failed (protocol mismatch, a malformed reply)."""

    def __init__(self, message: str, hint: str | None = None, unreachable: bool = True):
        super().__init__(message, hint)
        self.unreachable = unreachable


def parse(value: str | None, flag: str = "--rpc") -> tuple[str, ...]:
    """HOST:PORT[,HOST:PORT...] as llama.cpp's --rpc takes it; () for none."""
    if value is None or not value.strip():
        return ()
    out = []
    for item in (x.strip() for x in value.split(",")):
        host, colon, port = item.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"{flag} takes HOST:PORT servers, comma-separated: {item!r}",
                             hint=f"e.g. {flag} 192.168.1.10:{DEFAULT_PORT},"
                                  f"192.168.1.11:{DEFAULT_PORT}")
        if item not in out:
            out.append(item)
    if len(out) > 16:  # GGML_RPC_MAX_SERVERS
        raise UsageError(f"{flag}: {len(out)} servers; llama.cpp takes at most 16")
    return tuple(out)


def split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def probe(endpoint: str, timeout: float = 3.0) -> str | None:
    """None if something accepts connections at the endpoint, else why not. (A worker
    serves one client at a time; others wait in its backlog, which still accepts.)"""
    host, port = split(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except socket.gaierror as e:
        return f"unknown host ({e.strerror})"
    except OSError as e:
        return (e.strerror or str(e)).lower()


def check_reachable(endpoints: Sequence[str]) -> None:
    """Refuse, in one line, a worker that cannot be reached: llama.cpp would abort."""
    for ep in endpoints:
        why = probe(ep)
        if why is not None:
            host, port = split(ep)
            raise UsageError(f"--rpc: cannot reach the RPC server {ep}: {why}",
                             hint=f"start one there: specli rpc-server -H {host} -p {port}")


def check_bind_host(host: str) -> None:
    """rpc-server binds one IPv4 address (llama.cpp's inet_addr)."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise UsageError(f"-H/--host must be an IPv4 address, got {host!r}",
                         hint="127.0.0.1 (this machine only), a LAN address, or 0.0.0.0 "
                              "(every interface)") from None


_seen: dict[tuple[int, str], str] = {}  # (descriptor, socket inode) -> its endpoint
_addresses: dict[str, tuple[str, int]] = {}  # endpoint -> (IPv4 address, port), resolved once


def _address(endpoint: str) -> tuple[str, int] | None:
    if endpoint not in _addresses:
        host, port = split(endpoint)
        try:
            _addresses[endpoint] = (socket.gethostbyname(host), port)
        except OSError:
            return None
    return _addresses[endpoint]


def _connections(endpoints: Sequence[str]) -> list[tuple[str, int]]:
    """(endpoint, descriptor) for this process's TCP connections to the endpoints (one
    seen before still counts once reset, when it no longer has a peer to ask)."""
    want = {a: ep for ep in endpoints if (a := _address(ep)) is not None}
    out = []
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (or the listing's own descriptor)
            continue
        if not link.startswith("socket:["):
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                peer = s.getpeername() if s.family == socket.AF_INET else None
        except OSError:
            peer = None
        ep = want.get(peer) or _seen.get((fd, link))
        if ep is not None and ep in want.values():
            _seen[(fd, link)] = ep
            out.append((ep, fd))
    return out


def _each(endpoints: Sequence[str], fn: Callable[[socket.socket], object]) -> list:
    """(endpoint, fn(socket)) for each connection to the endpoints, through a duplicate of
    its descriptor (the options and counters are the socket's own); closed ones skipped."""
    out = []
    for ep, fd in _connections(endpoints):
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                out.append((ep, fn(s)))
        except OSError:  # closed meanwhile
            continue
    return out


def traffic(endpoints: Sequence[str]) -> tuple[int, int]:
    """Bytes this process has sent to the endpoints (acknowledged) and received from them,
    over its open connections (Linux's TCP_INFO: tcpi_bytes_acked, tcpi_bytes_received)."""
    infos = [i for _, i in _each(endpoints, lambda s: s.getsockopt(socket.IPPROTO_TCP,
                                                                   socket.TCP_INFO, 256))]
    return (sum(int.from_bytes(i[120:128], "little") for i in infos if len(i) >= 136),
            sum(int.from_bytes(i[128:136], "little") for i in infos if len(i) >= 136))


def keepalive(endpoints: Sequence[str], idle: int = 5, interval: int = 2, count: int = 3,
              user_timeout_ms: int = 20_000) -> int:
    """TCP keepalive and a user timeout on this process's connections to the workers
    (llama.cpp sets neither): a worker whose machine vanishes without closing them (power,
    cable) is then noticed in about idle + interval * count seconds, or when data sent to it
    stays unacknowledged for user_timeout_ms, instead of never. Returns how many were set."""
    def set_options(s: socket.socket) -> None:
        for level, opt, value in (
                (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
                (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle),
                (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval),
                (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count),
                (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout_ms)):
            s.setsockopt(level, opt, value)

    if not hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux's options
        return 0
    return len(_each(endpoints, set_options))


def closed(endpoints: Sequence[str]) -> dict[str, str]:
    """The workers whose connection from this process is no longer established (the worker
    closed it, or its machine reset it), read from the socket's state without sending a
    byte: a worker serves one client at a time, so a probe would queue behind this very
    connection. Workers this process holds no connection to are not listed."""
    states: dict[str, list[int]] = {}
    for ep, state in _each(endpoints, lambda s: s.getsockopt(socket.IPPROTO_TCP,
                                                             socket.TCP_INFO, 8)[0]):
        states.setdefault(ep, []).append(state)
    # tcpi_state 1: ESTABLISHED; 8: CLOSE_WAIT (the worker closed it); else: going away
    return {ep: "its connection was closed" for ep, st in states.items() if 1 not in st}


# -- a worker lost mid-call ---------------------------------------------------------------

Handler = Callable[[WorkerLost, tuple[str, ...]], None]
_handler: Handler | None = None


def on_lost(handler: Handler | None) -> None:
    """Who decides what happens when a worker is lost (None: print one line, exit 2)."""
    global _handler
    _handler = handler


def diagnose(message: str, eps: Sequence[str],
             logged: str | None = None) -> tuple[WorkerLost, tuple[str, ...]]:
    """The error for llama.cpp's abort message, naming those of the workers `eps` that no
    longer accept connections (the abort itself does not say which); logged: llama.cpp's
    last error line before it (a version mismatch says so there)."""
    for _ in range(4):  # a worker being killed may close our connection before its listener
        gone = {ep: why for ep in eps if (why := probe(ep, timeout=2.0)) is not None}
        if gone:
            break
        time.sleep(0.25)
    text = message.rsplit(": ", 1)[-1].strip() if ": " in message else message.strip()
    if logged:
        text = f"{logged.rstrip('.')}; {text}"
    if gone:
        if len(gone) == 1:
            what = "the RPC server {} is gone ({})".format(*next(iter(gone.items())))
        else:
            what = "the RPC servers " + ", ".join(f"{ep} ({why})" for ep, why in gone.items()
                                                  ) + " are gone"
        return (WorkerLost(what, hint="the model's layers there are lost; start the server "
                           "again and rerun"), tuple(gone))
    what = f"an RPC server ({', '.join(eps) or 'none added'}) failed: {text}"
    return (WorkerLost(what, hint="client and servers must run the same llama.cpp; rerun with "
                       "-v, and see the servers' output", unreachable=False), tuple(eps))


def lost(message: str, eps: Sequence[str], logged: str | None = None) -> None:
    """Called by backend/devices.py instead of llama.cpp's abort, with the workers added. Never
    returns: the thread that noticed cannot go on (llama.cpp aborts the moment this
    returns)."""
    error, gone = diagnose(message, eps, logged)
    handler = _handler
    if handler is not None:
        try:
            handler(error, gone)
        finally:
            threading.Event().wait()  # park this thread for good; the handler's threads go on
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os.write(2, f"error: {error.message} (hint: {error.hint})\n".encode())
    os._exit(error.exit_code)


INHERITED = "SPECLI_INHERITED_FDS"  # a server's listening sockets, kept across exec_self


def exec_self(keep: Sequence[int] = ()) -> None:
    """Start this process's command line again in place (same pid): the way back for a
    server whose model lost its layers with a worker. Every descriptor but stdio and `keep`
    (listening sockets: a --port 0 stays the same port, and connecting clients are not
    refused; named to the new image in SPECLI_INHERITED_FDS) is marked close-on-exec, so the
    workers see this client go and free what it held. Nothing is closed before the exec:
    other threads still run until it."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not stop the restart
            pass
    keep = sorted(set(keep))
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, fd in keep)
            except OSError:  # the listing's own descriptor, or closed meanwhile
                pass
    env = {**os.environ, INHERITED: ",".join(map(str, keep))}
    os.execve(sys.executable, sys.orig_argv, env)
