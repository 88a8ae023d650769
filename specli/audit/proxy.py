"""The isolated audit's network calls, made by the auditor: the destination read once (what
the namespace does not scope refused), then the call made on a copy of the caller's socket.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Callable

from specli.audit.events import (
    AF_INET,
    AF_INET6,
    AF_NETLINK,
    AF_UNIX,
    AF_UNSPEC,
    EXTERNAL,
    LOCAL,
    NetEvent,
    sockaddr,
)
from specli.audit.tracee import getfd, read_mem, write_mem

EMULATED = ("connect", "bind", "sendto", "sendmsg", "sendmmsg")


_MAX_SEND = 1 << 20  # bytes one emulated send may carry (more: EMSGSIZE)


_AF_PACKET = 17


_SCOPED = {AF_INET, AF_INET6, AF_NETLINK, _AF_PACKET, AF_UNSPEC}  # by the namespace


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


class Gone(Exception):
    """The caller is no longer waiting: its call is not made."""


_MSG_DONTWAIT = 0x40


class Call:
    """One network call of the isolated tree, made by the auditor: the destination read once
    (what a namespace does not scope refused), then the call made on a copy of the caller's
    socket with that copy of the destination."""

    def __init__(self, valid: Callable[[int], bool], nid: int, pid: int, tid: int, name: str,
                 a: list[int], events: list[NetEvent], where: str, t: float):
        self.valid, self.nid, self.pid, self.tid, self.name, self.a = valid, nid, pid, tid, name, a
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
            got = read_mem(self.tid, ptr, n)
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
        if family == AF_UNIX and len(raw) > 2 and raw[2:3] != b"\0":
            path = raw[2:].split(b"\0")[0].decode("utf-8", "replace")
            self._note(LOCAL, path, "unix", "refused: a unix socket path reaches processes "
                       "outside the namespace")
            raise _Refused(errno.EACCES)
        if family != AF_UNIX and family not in _SCOPED:
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
            got = getfd(self.tid, fd, thread=True)
        except OSError as e:
            raise _Refused(e.errno or errno.EBADF) from None
        if not self.valid(self.nid):
            os.close(got)
            raise Gone
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
        if not self.valid(self.nid):
            raise Gone

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
                write_mem(self.tid, at + i * _MMSG + ctypes.sizeof(_MsgHdr),
                           n.to_bytes(4, sys.byteorder))
                sent += 1
            return sent, 0
        finally:
            os.close(dup)
