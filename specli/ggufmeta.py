"""GGUF headers read straight from the file: metadata and the tensor index, never tensor data.

gguf's GGUFReader parses every field into numpy views up front (8.5 s for gemma-3-270m's
262,144-token vocabulary here); this walk reads the same format, with the gguf package's type
tables, in a fraction of that, and keeps only what the caller asks for. It is safe on hostile
files: every claimed length and count is checked against the bytes left before anything is
read or allocated, so a bad file fails at once, in one ModelFileError line that says why.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import mmap
import os
import struct
import sys
import types
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from specli.errors import ModelFileError

# gguf's type tables, loaded at the first header read (_tables): `--help`, `--version` and
# the audit's own processes never need them
_SCALARS: dict = {}


_CONSTANTS = "specli.ggufmeta.gguf_constants"  # the private copy's module name


def gguf_constants() -> types.ModuleType:
    """gguf.constants, the package's type tables, without the package's __init__: that imports
    its reader, writer, metadata and vocabulary modules (sentencepiece among them), 0.1 s of
    every start that only reads headers. gguf's own where the package is imported already;
    else a copy under a name of its own, so that a later `import gguf` runs whole as usual
    (`gguf.constants` included). Only names and values leave specli through it, and its
    IntEnums compare equal to gguf's by value. (backend._lib's stand-in package is for
    llama_cpp.llama_cpp, whose relative imports need a parent; constants.py has none.)"""
    for name in ("gguf.constants", _CONSTANTS):
        if name in sys.modules:
            return sys.modules[name]
    pkg = importlib.util.find_spec("gguf")  # a top-level package: found, not imported
    where = pkg.submodule_search_locations if pkg else None
    spec = where and importlib.util.spec_from_file_location(
        _CONSTANTS, os.path.join(where[0], "constants.py"))
    if not spec or not os.path.isfile(spec.origin):  # an unusual install: the plain way
        import gguf.constants

        return gguf.constants
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_CONSTANTS] = mod  # (dataclasses and enums look their module up)
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[_CONSTANTS]
        raise
    return mod


def _tables() -> None:
    global GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
    if _SCALARS:
        return
    c = gguf_constants()
    GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT = c.GGML_QUANT_SIZES, c.GGUF_DEFAULT_ALIGNMENT
    GGMLQuantizationType, GGUFValueType = c.GGMLQuantizationType, c.GGUFValueType
    t = GGUFValueType
    _SCALARS.update({t.UINT8: "B", t.INT8: "b", t.UINT16: "H", t.INT16: "h", t.UINT32: "I",
                     t.INT32: "i", t.FLOAT32: "f", t.BOOL: "?", t.UINT64: "Q", t.INT64: "q",
                     t.FLOAT64: "d"})


_MAX_KV = 1 << 20  # far beyond any real model's metadata
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NAME = 64  # GGML_MAX_NAME, the terminating zero included
_MAX_GGML_TYPE = 64  # types this gguf package does not know yet are accepted below this
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array: element type, length, its first elements, and the sha256 of the
    elements as stored (so two files' token lists compare without decoding either)."""

    element_type: str
    count: int
    preview: tuple
    sha256: str


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    type: str  # GGML type name: F32, Q4_K, ...
    offset: int  # within the data section
    n_bytes: int  # -1: a GGML type this gguf package does not know

    @property
    def n_params(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    path: str
    file_size: int
    version: int
    byte_order: str  # "little" or "big"
    kv: dict  # every scalar and string; arrays only where asked for (else see `arrays`)
    types: dict[str, str]  # key -> value type name (ARRAY[STRING] for arrays)
    arrays: dict[str, ArrayInfo] = field(default_factory=dict)
    tensors: tuple[Tensor, ...] = ()
    data_offset: int = 0

    @property
    def n_params(self) -> int:
        return sum(t.n_params for t in self.tensors)

    @property
    def tensor_bytes(self) -> int:
        return sum(max(t.n_bytes, 0) for t in self.tensors)


_INTS = {"I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


def tensor_ints(h: Header, name: str):
    """An integer tensor's values as a numpy array, read from the file (small ones: a
    head's vocabulary map); None where the file has no such tensor or it is not of an
    integer type. The index was checked against the file's size when the header was read."""
    t = next((t for t in h.tensors if t.name == name), None)
    if t is None or t.type not in _INTS:
        return None
    import numpy as np

    dtype = np.dtype(_INTS[t.type]).newbyteorder("<" if h.byte_order == "little" else ">")
    try:
        with open(h.path, "rb") as f:
            f.seek(h.data_offset + t.offset)
            raw = f.read(t.n_bytes)
    except OSError as e:
        raise ModelFileError(f"cannot read {h.path}: {e.strerror or e}") from None
    if len(raw) != t.n_bytes:
        raise invalid(h.path, f"tensor {name!r} is cut short")
    return np.frombuffer(raw, dtype)


# in read_header's `arrays`: every array of the file's own architecture ("<arch>.*": the
# per-layer values), as far as general.architecture comes before them (as writers put it)
ARCH_ARRAYS = "<arch>."


def read_header(path: str, arrays: Collection[str] = (), preview: int = 0) -> Header:
    """Read a GGUF file's metadata and tensor index.

    `arrays` names the array keys to decode in full into `kv` (ARCH_ARRAYS: the
    architecture's own); every array is summarised in `arrays` with `preview` leading
    elements. The tensor index is checked against the file
    size, so a download cut short is caught here rather than by llama.cpp after loading."""
    _tables()
    if not os.path.exists(path):
        raise ModelFileError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise invalid(path, "not a regular file")
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_size == 0:
                raise invalid(path, "empty file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                key = (path, st.st_dev, st.st_ino, st.st_size, frozenset(arrays), preview)
                hit = _read.get(key)
                if hit is not None and hit[0] == _digest(mm, hit[1].data_offset):
                    return hit[1]
                h = _Walk(mm, path, set(arrays), preview).header()
                _read.pop(key, None)
                _read[key] = (_digest(mm, h.data_offset), h)
                while len(_read) > _KEEP:
                    del _read[next(iter(_read))]
                return h
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror or e}") from None


# Headers read in this process, each kept with a digest of the bytes it was read from: a
# model loaded again (serve's slots, tune-draft's sweep, a pair checked then loaded) is
# parsed once, and a file rewritten since, whatever its size and timestamps, is read again.
_read: dict[tuple, tuple[bytes, Header]] = {}
_KEEP = 16


def _digest(buf, end: int) -> bytes:
    return hashlib.sha1(buf[:end], usedforsecurity=False).digest()


def invalid(path: str, why: str) -> ModelFileError:
    return ModelFileError(f"{path} is not a valid GGUF file ({why})",
                          hint="specli reads llama.cpp GGUF models")


class _Walk:
    """One pass over the header; `need` guards every read against the bytes left."""

    def __init__(self, buf, path: str, keep: set[str], preview: int):
        self.buf, self.path, self.keep, self.preview = buf, path, keep, preview
        self.size = len(buf)
        self.bo = "<"

    def fail(self, why: str) -> ModelFileError:
        return invalid(self.path, why)

    def need(self, pos: int, n: int, what: str) -> None:
        if n > self.size - pos:
            raise self.fail(f"{what} runs past the end of the file: truncated")

    def unpack(self, fmt: str, pos: int, what: str) -> tuple:
        fmt = self.bo + fmt
        self.need(pos, struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, pos)

    def string(self, pos: int) -> tuple[str, int]:
        (n,) = self.unpack("Q", pos, "a string length")
        self.need(pos + 8, n, f"a string of {n} bytes at byte {pos}")
        try:
            return bytes(self.buf[pos + 8:pos + 8 + n]).decode("utf-8"), pos + 8 + n
        except UnicodeDecodeError:
            raise self.fail(f"the string at byte {pos} is not UTF-8") from None

    def header(self) -> Header:
        buf = self.buf
        if buf[:4] != b"GGUF":
            raise self.fail(f"wrong magic {bytes(buf[:4])!r}: not a GGUF file")
        try:
            return self._header()
        except (struct.error, OverflowError, MemoryError, ValueError) as e:
            raise self.fail(f"damaged or truncated: {e}") from None

    def _header(self) -> Header:
        (version,) = self.unpack("I", 4, "the version")
        if not version & 0xFFFF and (version >> 24) in (2, 3):
            # a big-endian file reads as a huge version; llama.cpp on a little-endian host
            # refuses it, so specli does too (a verdict for a file llama.cpp cannot load
            # would mislead)
            raise self.fail("big-endian GGUF: llama.cpp cannot load it on this machine")
        if version not in (2, 3):
            raise self.fail(f"unsupported GGUF version {version}")
        n_tensors, n_kv = self.unpack("QQ", 8, "the header")
        if n_kv > _MAX_KV or n_kv * 12 > self.size:
            raise self.fail(f"claims {n_kv} metadata keys")
        if n_tensors * _MIN_TENSOR_INFO > self.size:
            raise self.fail(f"claims {n_tensors} tensors: truncated or damaged")
        pos, kv, types, arrays = 24, {}, {}, {}
        for _ in range(n_kv):
            key, pos = self.string(pos)
            if not key:  # llama.cpp's loader refuses these too
                raise self.fail(f"an empty key at byte {pos - 8}")
            if key in types:
                raise self.fail(f"duplicated key {key!r}")
            (vtype,) = self.unpack("I", pos, "a value type")
            start = pos + 4
            if vtype == GGUFValueType.ARRAY:
                arch = kv.get("general.architecture")
                keep = key in self.keep or (ARCH_ARRAYS in self.keep and isinstance(arch, str)
                                            and key.startswith(f"{arch}."))
                etype, n, items, pos = self.array(start, keep)
                digest = hashlib.sha256(self.buf[start + 12:pos]).hexdigest()
                first = tuple(items[:self.preview]) if items else self._first(start)
                arrays[key] = ArrayInfo(etype, n, first, digest)
                types[key] = f"ARRAY[{etype}]"
                if keep:
                    kv[key] = items
            else:
                kv[key], pos = self.value(vtype, start)
                types[key] = GGUFValueType(vtype).name
        tensors, data_offset = self.tensor_index(pos, n_tensors, kv, types)
        return Header(self.path, self.size, version, "little" if self.bo == "<" else "big",
                      kv, types, arrays, tensors, data_offset)

    def value(self, vtype: int, pos: int):
        if vtype == GGUFValueType.STRING:
            return self.string(pos)
        if vtype not in _SCALARS:
            raise self.fail(f"unknown value type {vtype} at byte {pos - 4}")
        fmt = _SCALARS[GGUFValueType(vtype)]
        return self.unpack(fmt, pos, "a value")[0], pos + struct.calcsize(fmt)

    def array(self, pos: int, keep: bool) -> tuple[str, int, list, int]:
        """(element type name, length, the elements if kept, the position after it)."""
        etype, n = self.unpack("IQ", pos, "an array header")
        pos += 12
        if etype in _SCALARS:  # fixed-size elements: skip (or read) in one go
            code = _SCALARS[GGUFValueType(etype)]
            item = struct.calcsize(code)
            self.need(pos, n * item, f"an array of {n} elements")
            items = list(struct.unpack_from(f"{self.bo}{n}{code}", self.buf, pos)) if keep else []
            return GGUFValueType(etype).name, n, items, pos + n * item
        if etype == GGUFValueType.ARRAY:  # gguf.cpp has no arrays of arrays
            raise self.fail(f"an array of arrays at byte {pos - 12}")
        if etype != GGUFValueType.STRING:
            raise self.fail(f"unknown value type {etype} at byte {pos - 12}")
        self.need(pos, n * 8, f"an array of {n} elements")  # each at least a length
        # the hot loop of a big vocabulary (100,000 strings a SmolLM2 header, read by every
        # process that loads a model), kept tight: the bounds are checked once, after it. A
        # string past the end moves pos past it, and a length cut off fails to unpack.
        length, buf, raw = struct.Struct(self.bo + "Q").unpack_from, self.buf, []
        try:
            if keep:
                append = raw.append
                for _ in range(n):
                    start = pos + 8
                    pos = start + length(buf, pos)[0]
                    append(buf[start:pos])
            else:
                for _ in range(n):
                    pos += 8 + length(buf, pos)[0]
        except (struct.error, OverflowError):
            pos = self.size + 1
        if pos > self.size:
            raise self.fail(f"an array of {n} strings runs past the end of the file: "
                            "truncated")
        try:  # decoded in one piece, split where no string has a NUL of its own
            items = b"\0".join(raw).decode("utf-8").split("\0") if raw else []
            if len(items) != len(raw):
                items = [b.decode("utf-8") for b in raw]
        except UnicodeDecodeError:
            raise self.fail(f"a string in the array at byte {pos} is not UTF-8") from None
        return GGUFValueType(etype).name, n, items, pos

    def _first(self, pos: int) -> tuple:
        """The first `preview` elements of an array that was skipped, for display."""
        if not self.preview:
            return ()
        etype, n = self.unpack("IQ", pos, "an array header")
        pos += 12
        out = []
        for _ in range(min(n, self.preview)):
            if etype == GGUFValueType.STRING:
                v, pos = self.string(pos)
            elif etype in _SCALARS:
                v, pos = self.value(etype, pos)
            else:
                break
            out.append(v)
        return tuple(out)

    def tensor_index(self, pos: int, n_tensors: int, kv: dict,
                     types: dict) -> tuple[tuple[Tensor, ...], int]:
        """gguf.cpp's checks: names under 64 bytes and unique, at most 4 dimensions, none
        negative, an element count that fits int64, a known type, and each tensor's data
        right after the previous one's (aligned), all within the file."""
        infos, names = [], set()
        for _ in range(n_tensors):
            name, pos = self.string(pos)
            if len(name.encode()) >= _MAX_NAME:
                raise self.fail(f"tensor name {name[:20]!r}... is {len(name.encode())} bytes "
                                f"(under {_MAX_NAME})")
            if name in names:
                raise self.fail(f"duplicated tensor {name!r}")
            names.add(name)
            (n_dims,) = self.unpack("I", pos, "a tensor's dimension count")
            if n_dims > _MAX_DIMS:
                raise self.fail(f"tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS})")
            shape = self.unpack(f"{n_dims}Q", pos + 4, "a tensor's shape")
            ttype, offset = self.unpack("IQ", pos + 4 + 8 * n_dims, "a tensor's type")
            pos += 4 + 8 * n_dims + 12
            if any(d >= 2**63 for d in shape):
                raise self.fail(f"tensor {name!r} has a negative dimension")
            n = math.prod(shape)
            if n >= 2**63:
                raise self.fail(f"tensor {name!r} claims {n} elements")
            try:
                qtype = GGMLQuantizationType(ttype)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                # newer than this gguf package: llama.cpp may know it; sizes are unknown
                if ttype >= _MAX_GGML_TYPE:
                    raise self.fail(f"tensor {name!r} has unknown type {ttype}") from None
                infos.append(Tensor(name, tuple(shape), f"type{ttype}", offset, -1))
                continue
            if shape and shape[0] % block:
                raise self.fail(f"tensor {name!r}: {shape[0]} is not a multiple of {block}")
            infos.append(Tensor(name, tuple(shape), qtype.name, offset, n // block * type_size))
        align = kv.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if "general.alignment" in types and types["general.alignment"] != "UINT32":
            raise self.fail(f"general.alignment is a {types['general.alignment']}, not UINT32")
        if align <= 0 or align & (align - 1):
            raise self.fail(f"general.alignment is {align}, not a power of two")
        data = -(-pos // align) * align
        expected = 0
        for t in infos:
            if t.n_bytes < 0:  # an unknown type's size: the layout cannot be checked further
                break
            if t.offset != expected:
                raise self.fail(f"tensor {t.name!r} is at offset {t.offset}, expected "
                                f"{expected}")
            expected += -(-t.n_bytes // align) * align
        end = max((t.offset + max(t.n_bytes, 0) for t in infos), default=0)
        if infos and data + end > self.size:
            raise self.fail(f"tensor data ends at byte {data + end} but the file has "
                            f"{self.size} bytes: truncated (an interrupted download?)")
        return tuple(infos), data


def file_sha256(path: str, progress: Callable[[int], None] | None = None,
                chunk: int = 8 << 20) -> str:
    """The file's sha256, read in chunks; `progress(n)` after each chunk of n bytes (a model
    file's identity: the audit's report, a converted head's cache key)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if progress:
                progress(len(block))
    return h.hexdigest()
