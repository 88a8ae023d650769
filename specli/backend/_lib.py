"""llama-cpp-python's ctypes library, loaded once: llama.cpp's log (silent unless -v; a
thread's last error line kept for messages), the backend initialised, and the ggml symbols
that llama.h does not wrap."""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import sys
import threading
import types


def _low_level() -> types.ModuleType:
    """llama_cpp.llama_cpp, the ctypes API, without running the package's __init__ first: that
    also imports the high-level Llama class (numpy, jinja2, diskcache, multiprocessing and its
    chat formats, about 0.1 s of every start), which specli never uses. The package stands
    in as its path alone, and runs its own __init__ the first time anything else is asked of
    it (`from llama_cpp import Llama` in the same process still works)."""
    if "llama_cpp" in sys.modules:
        return importlib.import_module("llama_cpp.llama_cpp")
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        import llama_cpp.llama_cpp as low  # an unusual install: the plain way

        return low
    pkg = importlib.util.module_from_spec(spec)
    lock, running = threading.RLock(), []

    def complete(name: str):
        with lock:  # once, whichever thread asks first; the others wait for it here
            if "__getattr__" in pkg.__dict__:
                if running:  # asked from inside its own __init__: not defined yet
                    raise AttributeError(name)
                running.append(True)
                try:
                    spec.loader.exec_module(pkg)
                finally:
                    running.clear()
                del pkg.__dict__["__getattr__"]  # from here, __init__ defined what it defines
                ll.llama_log_set(_log_callback, ctypes.c_void_p(0))  # it installed its own
        return getattr(pkg, name)

    pkg.__getattr__ = complete  # type: ignore[attr-defined]  # PEP 562, on first miss
    sys.modules["llama_cpp"] = pkg
    return importlib.import_module("llama_cpp.llama_cpp")


ll = _low_level()

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
_ggml = ll._lib


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
