"""The seccomp listener: every connect, addressed sendto, sendmsg and sendmmsg of the
audited tree, C code and raw syscalls included, waits here until its destination is
recorded (and, isolated, is made by the proxy).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
import time

from specli.audit.events import EXTERNAL, PROCESS, AuditError, NetEvent, sockaddr
from specli.audit.poller import cmdline
from specli.audit.proxy import EMULATED, Call, Gone
from specli.audit.tracee import Notif, NotifResp, exec_line, read_mem, tgid

SECCOMP_CONTINUE = 1  # SECCOMP_USER_NOTIF_FLAG_CONTINUE: the call goes on as if not watched


_SYSCALLS: dict[tuple[int, int], str] = {}


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
        from specli.audit._site import boot

        self.fd, self.t0, self.emulate = fd, t0, emulate
        self.events: list[NetEvent] = []
        self.calls = 0
        self.failed: BaseException | None = None
        self._lib = lib = boot.libseccomp()
        lib.seccomp_notify_alloc.argtypes = [ctypes.POINTER(ctypes.POINTER(Notif)),
                                             ctypes.POINTER(ctypes.POINTER(NotifResp))]
        lib.seccomp_notify_receive.argtypes = [ctypes.c_int, ctypes.POINTER(Notif)]
        lib.seccomp_notify_respond.argtypes = [ctypes.c_int, ctypes.POINTER(NotifResp)]
        lib.seccomp_notify_id_valid.argtypes = [ctypes.c_int, ctypes.c_uint64]
        lib.seccomp_notify_free.argtypes = [ctypes.POINTER(Notif), ctypes.POINTER(NotifResp)]
        lib.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p
        lib.seccomp_syscall_resolve_num_arch.argtypes = [ctypes.c_uint32, ctypes.c_int]
        self._req, self._resp = ctypes.POINTER(Notif)(), ctypes.POINTER(NotifResp)()
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
                ctypes.memset(req, 0, ctypes.sizeof(Notif))  # the kernel wants it zeroed
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
                if self.emulate and name in EMULATED:  # answered by _emulate, on a thread
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
                    found, valid = [NetEvent("syscall", EXTERNAL, tgid(tid), time.time() -
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
        resp = NotifResp(nid, val, -error if error else 0, 0)
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
        pid, t = tgid(tid), time.time() - self.t0
        where = f"{cmdline(pid)} (thread {tid})"
        events: list[NetEvent] = []
        val, err = -1, errno.EPERM
        try:
            val, err = Call(self.valid, nid, pid, tid, name, a, events, where, t).run()
        except Gone:
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
        pid = tgid(tid)
        addrs: list[bytes] = []
        if name in ("execve", "execveat"):  # a program starts: recorded, then it goes on
            return [NetEvent(name, PROCESS, pid, t, exec_line(tid, a, name == "execveat"),
                             "", f"{cmdline(pid)} (thread {tid})", None, "seccomp")]
        if name == "bind":  # unisolated, a listener is seen by the /proc poll
            return []
        try:
            if name == "connect":
                addrs.append(read_mem(tid, a[1], min(a[2], 128)))
            elif name == "sendto":
                addrs.append(read_mem(tid, a[4], min(a[5], 128)))
            elif name in ("sendmsg", "sendmmsg"):
                count, stride = (1, 56) if name == "sendmsg" else (min(a[2], 1024), 64)
                block = read_mem(tid, a[1], count * stride)
                for i in range(0, len(block) - 15, stride):
                    ptr = int.from_bytes(block[i:i + 8], sys.byteorder)
                    size = int.from_bytes(block[i + 8:i + 12], sys.byteorder)
                    if ptr:  # no name: a connected socket, whose connect was recorded
                        addrs.append(read_mem(tid, ptr, min(size, 128)))
        except OSError as e:
            return [NetEvent(name, EXTERNAL, pid, t, f"unreadable destination ({e.strerror})",
                             "", f"{cmdline(pid)} (thread {tid})", None, "seccomp")]
        out = []
        for raw in dict.fromkeys(addrs):
            found = sockaddr(raw, connect=name == "connect")
            if found is None:
                continue
            scope, address, proto = found
            out.append(NetEvent(name, scope, pid, t, address, proto,
                                f"{cmdline(pid)} (thread {tid})", None, "seccomp"))
        return out
