"""Requantizing GGUF files with llama.cpp (the SmolLM2 family, weaker drafts)."""

from __future__ import annotations

import ctypes
import os

from specli.backend._lib import ll
from specli.config import usable_cpus
from specli.errors import BackendError

QUANT_TYPES = {"f32": ll.LLAMA_FTYPE_ALL_F32, "f16": ll.LLAMA_FTYPE_MOSTLY_F16,
               "q8_0": ll.LLAMA_FTYPE_MOSTLY_Q8_0,
               # weaker drafts for draft-tree benchmarks (llama.cpp falls back to another
               # type for tensors whose rows are not a multiple of 256)
               "q2_k": ll.LLAMA_FTYPE_MOSTLY_Q2_K, "q3_k_s": ll.LLAMA_FTYPE_MOSTLY_Q3_K_S}


def quantize(src: str, dst: str, ftype: str) -> None:
    """Requantize a GGUF (e.g. Q4_1 -> F16) with llama.cpp; written to dst atomically."""
    params = ll.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[ftype]
    params.allow_requantize = True
    params.nthread = usable_cpus()
    tmp = f"{dst}.tmp{os.getpid()}"
    rc = ll.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise BackendError(f"llama_model_quantize failed ({rc}) on {src}")
    os.replace(tmp, dst)
