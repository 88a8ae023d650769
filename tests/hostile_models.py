"""Real, loadable GGUF models with one thing changed, for the hostile-input tests (issue 16):
a copy of a model file with metadata keys overridden or dropped and tensors rewritten."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from specli.ggufmeta import Header, read_header

T = gguf.GGUFValueType


def copy_gguf(src: str, dst: Path, set_kv: dict[str, tuple[object, T, T | None]] | None = None,
              drop: tuple[str, ...] = (),
              tensor: Callable[[str, np.ndarray], np.ndarray | None] | None = None,
              tensors: bool = True, add: dict[str, np.ndarray] | None = None) -> str:
    """dst: src with the keys in set_kv written as (value, type, array item type), the keys in
    drop left out, and each tensor's data passed through tensor(name, data) if given (None
    leaves the tensor out; data of another dtype is written as that type); the tensors in
    `add` appended; with tensors=False, the metadata alone (a header-only file, for checks
    that read no weights)."""
    set_kv = dict(set_kv or {})
    h, fields = _read(src)
    arch = set_kv.pop("general.architecture", (None,))[0]
    w = gguf.GGUFWriter(str(dst), arch or h.kv["general.architecture"])
    for key, (value, vtype, sub) in fields.items():
        if key not in drop and key not in set_kv:
            w.add_key_value(key, value, vtype, sub_type=sub)
    for key, (value, vtype, sub) in set_kv.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    datas = []
    for name, kind, raw in _tensors(src) if tensors else ():
        data = raw if tensor is None else tensor(name, np.array(raw))
        if data is None:
            continue
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes,
                          kind if data.dtype == raw.dtype else None)
        datas.append(data)
    for name, data in (add or {}).items():
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes)
        datas.append(data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for data in datas:
        w.write_tensor_data(data)
    w.close()
    return str(dst)


@functools.cache
def _read(src: str) -> tuple[Header, dict]:
    """The header, and its metadata as (value, type, array item type), read once (specli's
    own reader: gguf's GGUFReader takes seconds over a 49,152-token vocabulary)."""
    h = read_header(src)
    h = read_header(src, list(h.arrays))  # every array decoded too
    fields = {}
    for key, kind in h.types.items():
        if key == "general.architecture":
            continue
        info = h.arrays.get(key)
        fields[key] = ((h.kv[key], T.ARRAY, T[info.element_type]) if info is not None
                       else (h.kv[key], T[kind], None))
    return h, fields


def _tensors(src: str):
    """(name, GGML type, data) for each tensor, the data mapped from the file: float arrays
    in numpy's dimension order, quantized ones as rows of bytes (as GGUFReader gives them)."""
    h = _read(src)[0]
    mapped = np.memmap(src, dtype=np.uint8, mode="r")
    for t in h.tensors:
        kind = gguf.GGMLQuantizationType[t.type]
        raw = mapped[h.data_offset + t.offset:h.data_offset + t.offset + t.n_bytes]
        shape = tuple(reversed(t.shape))
        plain = {gguf.GGMLQuantizationType.F32: np.float32,
                 gguf.GGMLQuantizationType.F16: np.float16,
                 gguf.GGMLQuantizationType.I64: np.int64,
                 gguf.GGMLQuantizationType.I32: np.int32}.get(kind)
        if plain is not None:
            raw = raw.view(plain).reshape(shape)
        else:
            raw = raw.reshape(gguf.quant_shape_to_byte_shape(shape, kind))
        yield t.name, kind, raw


def with_template(src: str, dst: Path, template: str) -> str:
    return copy_gguf(src, dst, {"tokenizer.chat_template": (template, T.STRING, None)})


def with_nan(src: str, dst: Path, name: str = "output_norm.weight") -> str:
    """The final norm's weights NaN: every logit the model computes is NaN."""
    return copy_gguf(src, dst, tensor=lambda n, d: np.full_like(d, np.nan) if n == name else d)
