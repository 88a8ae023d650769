"""The network recorder of `specli audit`, for this process and its Python children.

`specli audit` (specli/audit/auditor.py) installs it in its own process and puts this directory
first on the children's PYTHONPATH, so that a Python child imports it at startup as its
`sitecustomize` and records into the same log. It must stay self-contained: a child may be
another interpreter that cannot import specli. Every record is one JSON line appended to
$SPECLI_AUDIT_LOG (one write per line, O_APPEND: a forked child appends safely); the auditor
classifies them. Python cannot remove an audit hook, so an uninstalled recorder is a no-op.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import threading
import time

LOG_ENV = "SPECLI_AUDIT_LOG"

# audit events that name a network endpoint: "sock" for a socket method (socket, address),
# otherwise where the host (and port) are in the event's arguments
_HOST_PORT = slice(1, 3)  # (self, host, port)
NETWORK = {
    "socket.connect": "sock", "socket.bind": "sock", "socket.sendto": "sock",
    "socket.sendmsg": "sock", "socket.getaddrinfo": slice(0, 2),
    "socket.gethostbyname": slice(0, 1), "socket.gethostbyaddr": slice(0, 1),
    "socket.getnameinfo": slice(0, 1), "urllib.Request": slice(0, 1),
    "webbrowser.open": slice(0, 1), "http.client.connect": _HOST_PORT,
    "ftplib.connect": _HOST_PORT, "smtplib.connect": _HOST_PORT, "imaplib.open": _HOST_PORT,
    "poplib.connect": _HOST_PORT, "nntplib.connect": _HOST_PORT,
    "telnetlib.Telnet.open": _HOST_PORT,
}
# process starts, and where the command line is in their arguments
PROCESS = {"subprocess.Popen": 1, "os.system": 0, "os.exec": 1, "os.posix_spawn": 1,
           "os.spawn": 2, "os.fork": None, "os.forkpty": None, "pty.spawn": 0,
           "os.startfile": 0}

_fd: int | None = None
_tls = threading.local()
_ids = iter(range(1, 1 << 62))
_prefix = ""  # random, per install: a Python that exec()s another keeps its pid
_WRAPPED = ("connect", "connect_ex", "sendto", "sendmsg")
_originals: dict[str, object] = {}


def install(path: str | None = None) -> bool:
    """Record into `path` (default: $SPECLI_AUDIT_LOG) from now on; False if there is none."""
    global _fd, _prefix
    path = path or os.environ.get(LOG_ENV)
    if not path or _fd is not None:
        return _fd is not None
    _prefix = os.urandom(4).hex()
    _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    if not _originals:  # the first install in this process: the hook stays for good
        sys.addaudithook(_hook)
    for name in _WRAPPED:  # None: inherited from _socket.socket, not set on socket.socket
        _originals[name] = vars(socket.socket).get(name)
        setattr(socket.socket, name, _outcome(getattr(socket.socket, name)))
    _originals["getaddrinfo"] = socket.getaddrinfo
    socket.getaddrinfo = _outcome(socket.getaddrinfo)
    return True


def uninstall() -> None:
    """Stop recording: the hook stays (Python cannot remove one) but does nothing."""
    global _fd
    if _fd is None:
        return
    fd, _fd = _fd, None  # first: a thread writing now must not reach a reused fd number
    os.close(fd)
    for name in _WRAPPED:
        if _originals[name] is None:
            delattr(socket.socket, name)
        else:
            setattr(socket.socket, name, _originals[name])
    socket.getaddrinfo = _originals["getaddrinfo"]


def _write(rec: dict) -> None:
    if _fd is not None:
        os.write(_fd, (json.dumps(rec, default=repr) + "\n").encode())


def _where() -> str:
    """The innermost caller outside this module and the socket machinery: who did it."""
    try:
        f = sys._getframe(2)
    except ValueError:  # no Python caller (an event raised from C)
        return "?"
    skip = (__file__, socket.__file__, "<frozen ", "/subprocess.py", "/threading.py")
    while f is not None and any(s in f.f_code.co_filename for s in skip):
        f = f.f_back
    if f is None:
        return "?"
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


def _hook(event: str, args: tuple) -> None:
    if _fd is None or (event not in NETWORK and event not in PROCESS):
        return
    if getattr(_tls, "busy", False):
        return
    _tls.busy = True
    rec = {"id": f"{os.getpid()}-{_prefix}-{next(_ids)}", "pid": os.getpid(), "t": time.time(),
           "event": event}
    try:  # the event is written whatever goes wrong in describing it
        rec["where"] = _where()
        where = NETWORK.get(event)
        if where == "sock":  # a socket method: the socket's family, and the call's address
            rec["family"] = int(getattr(args[0], "family", -1))
            rec["type"] = int(getattr(args[0], "type", -1))
            rec["address"] = _plain(args[1]) if len(args) > 1 else None
        elif where is not None:
            rec["address"] = _plain(args[where])
        elif PROCESS[event] is not None and len(args) > PROCESS[event]:
            rec["command"] = _plain(args[PROCESS[event]])
    except Exception as e:  # noqa: BLE001 - a recorder must never break the program it watches
        rec["error"] = repr(e)[:200]
    try:
        _tls.last = rec["id"]
        _write(rec)
    except Exception:  # noqa: BLE001
        pass
    finally:
        _tls.busy = False


def _plain(v):
    """Arguments as JSON can hold them (an address tuple, a path, a command line)."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, bytes):
        return v.decode("utf-8", "backslashreplace")
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v[:16]]
    return repr(v)[:200]


def _outcome(fn):
    """Wrap a socket call so that how it ended is recorded next to the hook's event."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        _tls.last = None
        try:
            result = fn(*args, **kwargs)
        except OSError as e:
            _ended(e.errno, e)
            raise
        if fn.__name__ == "connect_ex" and result:
            _ended(result, None)
        else:
            _ended(0, None)
        return result
    return call


def _ended(err: int | None, exc: BaseException | None) -> None:
    ref = getattr(_tls, "last", None)
    if ref is None:
        return
    _tls.last = None
    if exc is not None and isinstance(exc, socket.gaierror):
        outcome = f"name resolution failed: {exc.strerror or exc}"
    elif exc is not None and not err:  # a timeout has no errno
        outcome = type(exc).__name__
    elif err:
        import errno as _errno

        outcome = _errno.errorcode.get(err, str(err))
    else:
        outcome = "ok"
    try:
        _write({"ref": ref, "outcome": outcome})
    except Exception:  # noqa: BLE001
        pass


def _chain() -> None:
    """Run the sitecustomize this one shadows (a distribution's), as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None and spec.origin != __file__:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "sitecustomize":  # imported at a child's startup
    try:
        install()
        _chain()
    except Exception:  # noqa: BLE001 - as site.py does: a broken sitecustomize is not fatal
        pass
