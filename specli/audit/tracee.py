"""A watched thread's memory and descriptors, as the seccomp listener reads (and the proxy
writes) them: the notification structures, pidfd_getfd, /proc/TID/mem.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import sys
from pathlib import Path


class _SeccompData(ctypes.Structure):
    _fields_ = [("nr", ctypes.c_int), ("arch", ctypes.c_uint32),
                ("instruction_pointer", ctypes.c_uint64), ("args", ctypes.c_uint64 * 6)]


class Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("data", _SeccompData)]


class NotifResp(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


def getfd(pid: int, fd: int, thread: bool = False) -> int:
    """A copy of another process's descriptor (pidfd_getfd(2), Linux 5.6+; a parent may);
    `thread`: pid is a thread's id, whose own table is read (PIDFD_THREAD, Linux 6.9+; the
    process's where the kernel is older)."""
    pidfd = None
    if thread:
        try:
            pidfd = os.pidfd_open(pid, os.O_EXCL)  # PIDFD_THREAD
        except OSError:
            pid = tgid(pid)
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


def tgid(tid: int) -> int:
    try:
        for line in Path(f"/proc/{tid}/status").read_text().splitlines():
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return tid


def read_mem(tid: int, addr: int, n: int) -> bytes:
    fd = os.open(f"/proc/{tid}/mem", os.O_RDONLY)
    try:
        return os.pread(fd, n, addr)
    finally:
        os.close(fd)


def write_mem(tid: int, addr: int, data: bytes) -> None:
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
        chunk = read_mem(tid, addr, n)
        if b"\0" in chunk or not chunk:
            out += chunk.split(b"\0")[0]
            break
        out, addr = out + chunk, addr + n
    return out.decode("utf-8", "replace")


def exec_line(tid: int, a: list[int], at: bool) -> str:
    """The program an execve (or execveat) starts, with its arguments."""
    path_ptr, argv_ptr = (a[1], a[2]) if at else (a[0], a[1])
    try:
        path = _string(tid, path_ptr)
        argv = []
        for i in range(64):
            p = int.from_bytes(read_mem(tid, argv_ptr + 8 * i, 8), sys.byteorder) \
                if argv_ptr else 0
            if not p:
                break
            argv.append(_string(tid, p, 512))
    except OSError as e:
        return f"(unreadable: {e.strerror})"
    return shlex.join([path, *argv[1:]])
