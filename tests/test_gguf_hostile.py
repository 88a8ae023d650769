"""Hostile GGUF headers: each is one clear error (exit 2), at once, with no allocation sized by
a claimed length (issue 4, part 6)."""

from __future__ import annotations

import os
import struct
import time

import pytest
from conftest import specli

from specli.errors import ModelFileError
from specli.pairing import read_tokenizer

STRING, ARRAY, UINT32 = 8, 9, 4


def s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def header(n_kv: int, body: bytes = b"", n_tensors: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + body


def kv_string(key: bytes, value: bytes) -> bytes:
    return s(key) + struct.pack("<I", STRING) + s(value)


ARCH = kv_string(b"general.architecture", b"llama")

CASES = {
    "wrong magic": (b"GGML" + b"\0" * 40, "wrong magic"),
    "unsupported version": (header(0, version=99), "unsupported GGUF version 99"),
    "string length 2^63": (header(1, struct.pack("<Q", 2**63)), "past the end"),
    "10^12 keys": (header(10**12), "claims 1000000000000 metadata keys"),
    "10^12 tensors": (header(1, ARCH, n_tensors=10**12), "tensors"),
    "array of 2^40 elements": (header(1, s(b"tokenizer.ggml.tokens") + struct.pack(
        "<IIQ", ARRAY, STRING, 2**40)), "array of 1099511627776 elements"),
    "array of 2^40 scalars": (header(1, s(b"tokenizer.ggml.scores") + struct.pack(
        "<IIQ", ARRAY, UINT32, 2**40)), "array of 1099511627776 elements"),
    "duplicated key": (header(2, ARCH + ARCH), "duplicated key"),
    "non-UTF-8 key": (header(1, kv_string(b"general.\xff\xfe", b"x")), "not UTF-8"),
    "non-UTF-8 token": (header(1, s(b"tokenizer.ggml.tokens") + struct.pack(
        "<IIQ", ARRAY, STRING, 1) + s(b"\xc3\x28")), "not UTF-8"),
    "unknown value type": (header(1, s(b"general.x") + struct.pack("<I", 77)),
                           "unknown value type 77"),
    "truncated value": (header(1, s(b"general.x") + struct.pack("<I", UINT32) + b"\1"),
                        "truncated"),
    "empty file": (b"", "empty file"),
    # a string array's bounds are checked after its loop (ggufmeta._Walk.array): a string
    # past the end, a length past it, and a length cut off are each caught there
    "string past the end": (header(1, s(b"tokenizer.ggml.tokens") + struct.pack(
        "<IIQ", ARRAY, STRING, 2) + s(b"ab") + struct.pack("<Q", 50) + b"x" * 20),
        "array of 2 strings runs past the end"),
    "string length 2^64-1 in an array": (header(1, s(b"tokenizer.ggml.merges") + struct.pack(
        "<IIQ", ARRAY, STRING, 3) + s(b"ab") + struct.pack("<Q", 2**64 - 1) + b"x" * 40),
        "array of 3 strings runs past the end"),
    "string length cut off in an array": (header(1, s(b"tokenizer.ggml.tokens") + struct.pack(
        "<IIQ", ARRAY, STRING, 3) + s(b"a" * 30) + s(b"b") + b"\5\0\0"),
        "array of 3 strings runs past the end"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_headers_are_one_clear_error_at_once(tmp_path, name):
    data, needle = CASES[name]
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError) as e:
        read_tokenizer(str(p))
    assert time.perf_counter() - t0 < 1.0
    assert "is not a valid GGUF file" in e.value.message and needle in e.value.message, \
        e.value.message


def test_a_directory_and_a_fifo_are_not_gguf_files(tmp_path):
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)  # opening it for reading would block: it must never be opened
    for p in (tmp_path, fifo):
        with pytest.raises(ModelFileError, match="not a regular file"):
            read_tokenizer(str(p))


def test_the_cli_says_it_in_one_line_and_exits_2(tmp_path):
    p = tmp_path / "dup.gguf"
    p.write_bytes(CASES["duplicated key"][0])
    r = specli("run", "-m", str(p), "-p", "hi")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a valid GGUF file (duplicated key" in lines[0], r.stderr


def test_a_header_read_again_is_the_files_bytes_now(tmp_path):
    """read_header keeps what it parsed, for a model loaded again; a file rewritten in place
    since (same size, same inode, within one timestamp tick) is read again, not served stale."""
    from specli.ggufmeta import read_header

    path = tmp_path / "m.gguf"
    path.write_bytes(header(2, ARCH + kv_string(b"general.name", b"first")))
    assert read_header(str(path)).kv["general.name"] == "first"
    assert read_header(str(path)) is read_header(str(path))  # kept
    with open(path, "r+b") as f:  # the same length, the same file
        data = f.read()
        f.seek(data.index(b"first"))
        f.write(b"other")
    assert read_header(str(path)).kv["general.name"] == "other"
    with open(path, "r+b") as f:  # now damaged: the error, not the header kept before
        f.write(b"GGML")
    with pytest.raises(ModelFileError, match="wrong magic"):
        read_header(str(path))


def test_token_strings_with_nuls_and_multibyte_text_read_back_as_written(tmp_path):
    """The kept strings are decoded in one piece and split at NULs: a token with a NUL of its
    own (or an empty one) must still come back whole and in its place."""
    from specli.ggufmeta import read_header

    tokens = [b"a\0b", "\u00e9t\u00e9".encode(), b"", b"\0", "\u0120the".encode()]
    p = tmp_path / "t.gguf"
    p.write_bytes(header(1, s(b"tokenizer.ggml.tokens") + struct.pack(
        "<IIQ", ARRAY, STRING, len(tokens)) + b"".join(s(t) for t in tokens)))
    got = read_header(str(p), {"tokenizer.ggml.tokens"}).kv["tokenizer.ggml.tokens"]
    assert got == [t.decode() for t in tokens]
    tokens = tokens[1:2] + tokens[4:]  # without NULs: the one-piece path
    p.write_bytes(header(1, s(b"tokenizer.ggml.tokens") + struct.pack(
        "<IIQ", ARRAY, STRING, len(tokens)) + b"".join(s(t) for t in tokens)))
    assert read_header(str(p), {"tokenizer.ggml.tokens"}).kv["tokenizer.ggml.tokens"] == \
        [t.decode() for t in tokens]


@pytest.mark.parametrize("arch_first", [True, False])
def test_per_layer_values_are_decoded_in_one_pass_when_the_architecture_comes_first(
        tmp_path, monkeypatch, arch_first):
    """loadable.read decodes the architecture's arrays (per-layer values) with the tokens:
    one walk of the header where general.architecture comes first, a second only where an
    array of it came before it."""
    from specli import ggufmeta, loadable

    layers = s(b"llama.swa_layers") + struct.pack("<IIQ", ARRAY, UINT32, 3) + \
        struct.pack("<3I", 1, 0, 1)
    tokens = s(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 2) + \
        s(b"a") + s(b"b")
    p = tmp_path / "m.gguf"
    p.write_bytes(header(3, (ARCH + layers if arch_first else layers + ARCH) + tokens))
    walks = []
    header_of = ggufmeta._Walk.header
    monkeypatch.setattr(ggufmeta._Walk, "header", lambda w: walks.append(1) or header_of(w))
    h = loadable.read(str(p))
    assert h.kv["llama.swa_layers"] == [1, 0, 1] and h.kv["tokenizer.ggml.tokens"] == ["a", "b"]
    assert len(walks) == (1 if arch_first else 2)
