"""llama-cpp-python's ctypes library, loaded once: llama.cpp's log (silent unless -v; a
thread's last error line kept for messages), the backend initialised, and the ggml symbols
that llama.h does not wrap."""

from __future__ import annotations

import ctypes
import sys
import threading

import llama_cpp as ll

_log_lock = threading.Lock()
_log_verbose = False


_GGML_LOG_LEVEL_ERROR = 4  # ggml.h
_log_last = threading.local()  # this thread's last error line (a grammar's parse error)


@ll.llama_log_callback
def _log_callback(level, text, user_data):  # llama.cpp's log: silent unless -v
    line = text.decode("utf-8", errors="replace")
    if level == _GGML_LOG_LEVEL_ERROR:
        _log_last.error = line.strip()
    if _log_verbose:
        sys.stderr.write(line)


def set_verbose(verbose: bool) -> None:
    global _log_verbose
    with _log_lock:
        _log_verbose = verbose


ll.llama_log_set(_log_callback, ctypes.c_void_p(0))
ll.llama_backend_init()


# libllama's handle reaches the ggml symbols it links against (dlsym searches dependencies)
_ggml = ll.llama_cpp._lib


def ggml_fn(name: str, restype, *argtypes):
    """A ggml C function, typed."""
    f = getattr(_ggml, name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


P = ctypes.c_void_p


def last_error() -> str | None:
    """This thread's last error line from llama.cpp (a grammar's parse error)."""
    return getattr(_log_last, "error", None)


def clear_error() -> None:
    _log_last.error = None
