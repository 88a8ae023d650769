"""llama.cpp's functions for the draft heads that llama-cpp-python does not bind: those
src/llama-ext.h declares without C linkage, bound here by their exported C++ names, and the
check that a build has everything a head type needs (before any weights load)."""

from __future__ import annotations

import ctypes

import numpy as np

from specli.backend._lib import ll
from specli.errors import BackendError, UsageError

_P, _F = ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)

# llama-ext.h: name -> (exported symbol, restype, argtypes)
_EXT = {
    "llama_set_embeddings_nextn": (
        "_Z26llama_set_embeddings_nextnP13llama_contextbb", None,
        [_P, ctypes.c_bool, ctypes.c_bool]),
    "llama_get_embeddings_nextn": ("_Z26llama_get_embeddings_nextnP13llama_context", _P, [_P]),
    "llama_get_embeddings_nextn_ith": (
        "_Z30llama_get_embeddings_nextn_ithP13llama_contexti", _P, [_P, ctypes.c_int32]),
    "llama_set_nextn_layer_offset": (
        "_Z28llama_set_nextn_layer_offsetP13llama_contexti", None, [_P, ctypes.c_int32]),
    "llama_set_embeddings_layer_inp": (
        "_Z30llama_set_embeddings_layer_inpP13llama_contextjb", None,
        [_P, ctypes.c_uint32, ctypes.c_bool]),
    "llama_get_embeddings_layer_inp": (
        "_Z30llama_get_embeddings_layer_inpP13llama_contextj", _P, [_P, ctypes.c_uint32]),
    "llama_get_ctx_other": ("_Z19llama_get_ctx_otherP13llama_context", _P, [_P]),
}
# the C functions and names each head type needs of llama-cpp-python's bindings
_C = ("llama_batch_ext_init", "llama_batch_ext_add_token", "llama_batch_ext_add_embd",
      "llama_batch_ext_set_pos", "llama_batch_ext_set_embd_token",
      "llama_batch_ext_set_output_logits", "llama_batch_ext_clear",
      "llama_batch_ext_free", "llama_process", "llama_embd", "LLAMA_PROCESS_TYPE_DECODE",
      "LLAMA_PROCESS_TYPE_ENCODE")
NEEDS = {
    "draft-mtp": (*_C, "LLAMA_CONTEXT_TYPE_MTP", "llama_model_n_layer_nextn",
                  "llama_set_embeddings_nextn", "llama_get_embeddings_nextn",
                  "llama_get_embeddings_nextn_ith", "llama_set_nextn_layer_offset",
                  "llama_get_ctx_other"),
    "draft-eagle3": (*_C, "llama_set_embeddings_nextn", "llama_get_embeddings_nextn",
                     "llama_get_embeddings_nextn_ith", "llama_set_embeddings_layer_inp",
                     "llama_get_embeddings_layer_inp"),
    "draft-dflash": (*_C, "llama_set_embeddings_nextn", "llama_set_embeddings_layer_inp",
                     "llama_get_embeddings_layer_inp", "llama_set_causal_attn"),
}
NEEDS["draft-dspark"] = NEEDS["draft-dflash"]
_bound: dict[str, object] = {}


def fn(name: str):
    """A llama.cpp function: llama-cpp-python's binding, else llama-ext.h's by its symbol."""
    f = _bound.get(name)
    if f is None:
        if name in _EXT:
            symbol, restype, argtypes = _EXT[name]
            f = getattr(ll._lib, symbol)
            f.restype, f.argtypes = restype, argtypes
        else:
            f = getattr(ll, name)
        _bound[name] = f
    return f


def missing(spec_type: str) -> list[str]:
    """What this llama-cpp-python build lacks of what a head type needs."""
    out = []
    for name in NEEDS.get(spec_type, ()):
        try:
            fn(name)
        except AttributeError:
            out.append(name)
    return out


def require(spec_type: str) -> None:
    """UsageError (exit 2) when this build cannot run the head type: before any weights."""
    lack = missing(spec_type)
    if lack:
        raise UsageError(f"--spec-type {spec_type} needs {lack[0]}, which this "
                         "llama-cpp-python build lacks",
                         hint="install llama-cpp-python 0.3.36 or newer (pip install -U "
                         "'llama-cpp-python>=0.3.36')")


def rows(name: str, ctx, *args: int, shape: tuple[int, ...]) -> np.ndarray:
    """A copy of the float rows a llama-ext.h getter returns (the nextn states, a layer's
    input), shape rows x n_embd; BackendError when the context kept none."""
    addr = fn(name)(ctx, *args)
    if not addr:
        raise BackendError(f"internal: {name} read from a decode that kept none")
    return view(addr, shape).copy()


_views: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}


def view(addr: int, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 array of `shape` at address addr (a float pointer's:
    `ctypes.addressof(ptr.contents)`), one view kept per (address, shape):
    llama.cpp moves an output buffer only when it grows it, and building a view through
    ctypes costs 30 us between two decodes (every draft step reads a few)."""
    key = (addr, shape)
    v = _views.get(key)
    if v is None:
        if len(_views) > 256:
            _views.clear()
        v = _views[key] = np.ctypeslib.as_array(ctypes.cast(addr, _F), shape)
    return v
