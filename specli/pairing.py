"""Draft/target compatibility from GGUF metadata alone (the `gguf` package, no weights loaded).

One policy, `check_pair`, used by engine load and (later) by `specli check-pair`: llama.cpp's
rules from common/speculative.cpp, so a pair specli accepts is one llama.cpp accepts too.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

from gguf import GGUFValueType

from specli.errors import IncompatiblePairError, ModelFileError

# llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE and SPEC_VOCAB_CHECK_START_TOKEN_ID
VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


@dataclass(frozen=True)
class TokenizerInfo:
    """Tokenizer metadata with llama.cpp's defaults filled in where a key is absent."""

    path: str
    architecture: str | None
    model: str | None  # tokenizer.ggml.model: gpt2, llama, ...
    pre: str | None
    tokens: tuple[str, ...]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool | None
    add_eos: bool | None

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    rule: str | None = None  # the first rule that failed
    message: str = "compatible"


_WANTED = {
    "general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
}


def read_tokenizer(path: str) -> TokenizerInfo:
    """Read the tokenizer metadata of a GGUF file; ModelFileError if it is not a readable GGUF."""
    kv = read_header(path, _WANTED)
    model, pre = kv.get("tokenizer.ggml.model"), kv.get("tokenizer.ggml.pre")
    bos, eos, add_bos, add_eos = _defaults(model, pre)
    add_bos = bool(kv.get("tokenizer.ggml.add_bos_token", add_bos))
    if pre == "gemma4":  # llama.cpp forces BOS on for Gemma 4 whatever the file says
        add_bos = True
    return TokenizerInfo(
        path=path,
        architecture=kv.get("general.architecture"),
        model=model,
        pre=pre,
        tokens=tuple(kv.get("tokenizer.ggml.tokens", ())),
        bos_id=kv.get("tokenizer.ggml.bos_token_id", bos),
        eos_id=kv.get("tokenizer.ggml.eos_token_id", eos),
        add_bos=add_bos,
        add_eos=bool(kv.get("tokenizer.ggml.add_eos_token", add_eos)),
    )


# llama.cpp's vocabulary types and the defaults llama-vocab.cpp uses when a key is absent
_VOCAB_TYPE = {"llama": "spm", "bert": "wpm", "gpt2": "bpe", "hybriddna": "bpe",
               "whitespace": "bpe", "gemma4": "bpe", "t5": "ugm", "rwkv": "rwkv",
               "plamo2": "plamo2", "none": "none", "no_vocab": "none"}
_BPE_ADD_BOS_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                    "midm-2.0", "lfm2", "jina-v5-nano", "tekken", "chameleon"}


def vocab_type(model: str | None) -> str | None:
    return _VOCAB_TYPE.get(model or "", model)


def _defaults(model: str | None, pre: str | None) -> tuple[int | None, int | None, bool, bool]:
    """(bos id, eos id, add BOS, add EOS) before the file's own keys override them."""
    t = vocab_type(model)
    if t == "spm":
        return 1, 2, True, False
    if t == "wpm":
        return 101, None, True, False
    if t == "bpe":
        bos = None if pre in ("chatglm-bpe", "glm4", "glm5") else 11
        return bos, 11, pre in _BPE_ADD_BOS_PRE, False
    if t == "ugm":
        return None, 1, False, True
    if t == "plamo2":
        return 1, 2, False, False
    return None, None, False, False


# The header walk reads only the key/value section, not the tensor index or data: gguf's
# GGUFReader parses every field into numpy views, which takes seconds on a 262k-token vocab.
_SCALARS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


def read_header(path: str, wanted: set[str]) -> dict:
    """The wanted keys of a GGUF file's key/value section, read straight from the header.

    Safe on hostile files: every claimed length and count is checked against the bytes left
    before anything is read or allocated, so a bad file fails at once, in one
    ModelFileError line that says what is wrong.
    """
    if not os.path.exists(path):
        raise ModelFileError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise _invalid(path, "not a regular file")
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise _invalid(path, "empty file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _read_kv(mm, path, wanted)
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror or e}") from None


def _invalid(path: str, why: str) -> ModelFileError:
    return ModelFileError(f"{path} is not a valid GGUF file ({why})",
                          hint="specli reads llama.cpp GGUF models")


_MAX_KV = 1 << 20  # far beyond any real model's metadata
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


def _read_kv(buf, path: str, wanted: set[str]) -> dict:
    size = len(buf)
    if buf[:4] != b"GGUF":
        raise _invalid(path, f"wrong magic {bytes(buf[:4])!r}: not a GGUF file")
    try:
        (version,) = struct.unpack_from("<I", buf, 4)
        bo = "<" if version & 0xFFFF else ">"  # a big-endian file reads as a huge version
        (version,) = struct.unpack_from(bo + "I", buf, 4)
        if version not in (2, 3):
            raise _invalid(path, f"unsupported GGUF version {version}")
        n_tensors, n_kv = struct.unpack_from(bo + "QQ", buf, 8)
        if n_kv > _MAX_KV or n_kv * 12 > size:
            raise _invalid(path, f"claims {n_kv} metadata keys")
        if n_tensors * _MIN_TENSOR_INFO > size:
            raise _invalid(path, f"claims {n_tensors} tensors: truncated or damaged")
        pos, out, seen = 24, {}, set()

        def need(pos: int, n: int, what: str) -> None:
            if n > size - pos:
                raise _invalid(path, f"{what} runs past the end of the file: truncated")

        def string(pos: int) -> tuple[str, int]:
            need(pos, 8, "a string length")
            (n,) = struct.unpack_from(bo + "Q", buf, pos)
            need(pos + 8, n, f"a string of {n} bytes at byte {pos}")
            try:
                return bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8"), pos + 8 + n
            except UnicodeDecodeError:
                raise _invalid(path, f"the string at byte {pos} is not UTF-8") from None

        def value(vtype: int, pos: int, keep: bool, depth: int = 0):
            if vtype == GGUFValueType.STRING:
                return string(pos)
            if vtype == GGUFValueType.ARRAY:
                if depth > 2:
                    raise _invalid(path, f"arrays nested too deep at byte {pos}")
                need(pos, 12, "an array header")
                etype, n = struct.unpack_from(bo + "IQ", buf, pos)
                pos += 12
                if etype in _SCALARS:  # fixed-size elements: skip (or read) in one go
                    item = struct.calcsize(_SCALARS[etype])
                    need(pos, n * item, f"an array of {n} elements")
                    items = (list(struct.unpack_from(f"{bo}{n}{_SCALARS[etype]}", buf, pos))
                             if keep else None)
                    return items, pos + n * item
                if etype not in (GGUFValueType.STRING, GGUFValueType.ARRAY):
                    raise _invalid(path, f"unknown value type {etype} at byte {pos - 12}")
                need(pos, n * 8, f"an array of {n} elements")  # each at least a length
                items = [] if keep else None
                for _ in range(n):
                    v, pos = value(etype, pos, keep, depth + 1)
                    if keep:
                        items.append(v)
                return items, pos
            if vtype not in _SCALARS:
                raise _invalid(path, f"unknown value type {vtype} at byte {pos - 4}")
            fmt = bo + _SCALARS[GGUFValueType(vtype)]
            need(pos, struct.calcsize(fmt), "a value")
            return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)

        for _ in range(n_kv):
            key, pos = string(pos)
            if key in seen:  # llama.cpp's loader refuses these too
                raise _invalid(path, f"duplicated key {key!r}")
            seen.add(key)
            need(pos, 4, "a value type")
            (vtype,) = struct.unpack_from(bo + "I", buf, pos)
            v, pos = value(vtype, pos + 4, key in wanted)
            if key in wanted:
                out[key] = v
        return out
    except (struct.error, OverflowError, MemoryError) as e:
        raise _invalid(path, f"damaged or truncated: {e}") from None


def check_pair(target: TokenizerInfo, draft: TokenizerInfo) -> Verdict:
    """llama.cpp's compatibility rules, in its order; the first failure is the verdict."""
    if vocab_type(target.model) != vocab_type(draft.model):
        return Verdict(False, "vocab-type", f"vocab types differ: target {target.model}, "
                       f"draft {draft.model}")
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos_id != draft.bos_id):
        return Verdict(False, "bos", f"BOS differs: target add={target.add_bos} "
                       f"id={target.bos_id}, draft add={draft.add_bos} id={draft.bos_id}")
    if target.add_eos != draft.add_eos or (target.add_eos and target.eos_id != draft.eos_id):
        return Verdict(False, "eos", f"EOS differs: target add={target.add_eos} "
                       f"id={target.eos_id}, draft add={draft.add_eos} id={draft.eos_id}")
    diff = abs(target.n_vocab - draft.n_vocab)
    if diff > VOCAB_MAX_SIZE_DIFFERENCE:
        return Verdict(False, "vocab-size", f"vocab sizes differ by {diff} (more than "
                       f"{VOCAB_MAX_SIZE_DIFFERENCE}): target {target.n_vocab}, "
                       f"draft {draft.n_vocab}")
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
        if target.tokens[i] != draft.tokens[i]:
            return Verdict(False, "token-text", f"token {i} differs: target {target.tokens[i]!r}, "
                           f"draft {draft.tokens[i]!r}")
    return Verdict(True)


def ensure_compatible(target: str | TokenizerInfo, draft_path: str) -> None:
    """Raise IncompatiblePairError (exit 1) naming the failed rule, or return quietly."""
    if isinstance(target, str):
        target = read_tokenizer(target)
    verdict = check_pair(target, read_tokenizer(draft_path))
    if not verdict.ok:
        raise IncompatiblePairError(
            f"incompatible draft/target pair ({verdict.rule}): {verdict.message}",
            rule=verdict.rule or "",
            hint="the draft must share the target's tokenizer (same model family)",
        )
