"""Model files as llama.cpp maps them: checked before a load, and watched while in use."""

from __future__ import annotations

import ctypes
import os
import sys
import threading

from specli.errors import ModelFileError


def check_gguf(path: str) -> None:
    if not os.path.isfile(path):
        raise ModelFileError(f"model file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFileError(f"not a GGUF file: {path}",
                                 hint="specli reads llama.cpp GGUF models")
        st = os.fstat(f.fileno())
    _MAPPED[os.path.abspath(path)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    _catch_sigbus()


# -- a model file cut while in use --------------------------------------------------------------
# llama.cpp reads the weights through mmap: a file truncated under it turns the next read of a
# page past the new end into SIGBUS, which kills the process without a word. The handler says
# which file changed, in one line, and exits 2. It runs on the faulting thread (a ggml worker,
# or ours inside llama_decode, the GIL released), which can never resume.

_MAPPED: dict[str, tuple[int, int, int]] = {}  # path -> (inode, size, mtime) when loaded
_SIGBUS_HANDLER = None


def _changed() -> list[str]:
    out = []
    for path, seen in list(_MAPPED.items()):
        try:
            st = os.stat(path)
            if (st.st_ino, st.st_size, st.st_mtime_ns) != seen:
                out.append(path)
        except OSError:
            out.append(path)
    return out


def _on_sigbus(signum: int) -> None:
    changed = _changed()
    what = (f"{', '.join(changed)} changed while in use (truncated or rewritten)" if changed
            else "a memory-mapped file was cut short while in use (SIGBUS)")
    os.write(2, f"error: {what}: the weights cannot be read any more (hint: do not rewrite a "
                f"model file that a running specli reads; copy, then rename over it)\n"
             .encode("utf-8", "replace"))
    os._exit(2)


_SIGBUS_LOCK = threading.Lock()


def _catch_sigbus() -> None:
    """Install _on_sigbus as SIGBUS's handler, once (Linux: glibc's struct sigaction). The
    handler runs Python on the faulting thread, which is not async-signal-safe in general;
    here that thread can never resume, and the handler only writes one line and exits."""
    global _SIGBUS_HANDLER
    if not sys.platform.startswith("linux"):
        return
    with _SIGBUS_LOCK:
        if _SIGBUS_HANDLER is None:
            _SIGBUS_HANDLER = _install_sigbus()


def _install_sigbus():
    import signal

    handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(_on_sigbus)

    class SigAction(ctypes.Structure):
        _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16),
                    ("flags", ctypes.c_int), ("restorer", ctypes.c_void_p)]

    act = SigAction()
    act.handler = ctypes.cast(handler, ctypes.c_void_p)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sigaction(int(signal.SIGBUS), ctypes.byref(act), None)
    return handler  # kept alive by the caller: C holds its address
