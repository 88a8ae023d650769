"""Real, loadable GGUF models with one thing changed, for the hostile-input tests (issue 16):
a copy of a model file with metadata keys overridden or dropped and tensors rewritten."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

T = gguf.GGUFValueType


def copy_gguf(src: str, dst: Path, set_kv: dict[str, tuple[object, T, T | None]] | None = None,
              drop: tuple[str, ...] = (),
              tensor: Callable[[str, np.ndarray], np.ndarray] | None = None,
              tensors: bool = True) -> str:
    """dst: src with the keys in set_kv written as (value, type, array item type), the keys in
    drop left out, and each tensor's data passed through tensor(name, data) if given; with
    tensors=False, the metadata alone (a header-only file, for checks that read no weights)."""
    set_kv = dict(set_kv or {})
    r, fields = _read(src)
    arch = set_kv.pop("general.architecture", (None,))[0]
    w = gguf.GGUFWriter(str(dst), arch or r.fields["general.architecture"].contents())
    for key, (value, vtype, sub) in fields.items():
        if key not in drop and key not in set_kv:
            w.add_key_value(key, value, vtype, sub_type=sub)
    for key, (value, vtype, sub) in set_kv.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    datas = []
    for t in r.tensors if tensors else ():
        data = np.array(t.data) if tensor is None else tensor(t.name, np.array(t.data))
        w.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, t.tensor_type)
        datas.append(data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for data in datas:
        w.write_tensor_data(data)
    w.close()
    return str(dst)


@functools.cache
def _read(src: str) -> tuple[gguf.GGUFReader, dict]:
    """The file, and its metadata decoded once (the token list takes seconds to decode)."""
    r = gguf.GGUFReader(src)
    fields = {}
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = T(field.types[0])
        fields[key] = (field.contents(), vtype, T(field.types[1]) if vtype == T.ARRAY else None)
    return r, fields


def with_template(src: str, dst: Path, template: str) -> str:
    return copy_gguf(src, dst, {"tokenizer.chat_template": (template, T.STRING, None)})


def with_nan(src: str, dst: Path, name: str = "output_norm.weight") -> str:
    """The final norm's weights NaN: every logit the model computes is NaN."""
    return copy_gguf(src, dst, tensor=lambda n, d: np.full_like(d, np.nan) if n == name else d)
