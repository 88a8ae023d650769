"""Fuzzing the GGUF header reader with corrupted copies of a valid file (issue 4): whatever the
bytes, the result is a report or one ModelFileError, quickly, in bounded memory."""

from __future__ import annotations

import struct
import tracemalloc

import gguf
import numpy as np
import pytest
from conftest import cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specli.errors import ModelFileError
from specli.pairing import compare, read_model_info

MEMORY_BOUND = 32 << 20  # bytes: far above what a few-kilobyte file needs, far below a claim


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "seed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([f"t{i}" for i in range(64)])
    w.add_token_merges([f"t{i} t{i + 1}" for i in range(16)])
    w.add_token_types([1] * 64)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_tensor("token_embd.weight", np.zeros((64, 8), dtype=np.float32))
    w.add_tensor("output.weight", np.zeros((64, 8), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


# u64 values that make a length or count absurd, and ones that are merely wrong
_BIG = st.sampled_from([0, 1, 7, 255, 2**31, 2**32 - 1, 2**40, 2**62, 2**63, 2**64 - 1])
_MUTATION = st.one_of(
    st.tuples(st.just("byte"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("u64"), st.integers(0, 10**6), _BIG | st.integers(0, 2**64 - 1)),
    st.tuples(st.just("u32"), st.integers(0, 10**6), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.integers(0, 255)),
)


def mutate(data: bytes, mutations) -> bytes:
    b = bytearray(data)
    for kind, where, value in mutations:
        i = where % max(len(b), 1)
        if kind == "byte" and b:
            b[i] = value
        elif kind == "u64" and len(b) >= 8:
            b[min(i, len(b) - 8):min(i, len(b) - 8) + 8] = struct.pack("<Q", value)
        elif kind == "u32" and len(b) >= 4:
            b[min(i, len(b) - 4):min(i, len(b) - 4) + 4] = struct.pack("<I", value)
        elif kind == "cut":
            del b[i:]
        elif kind == "insert":
            b[i:i] = bytes([value]) * (1 + value % 8)
    return bytes(b)


# the header proper is the first few hundred bytes: aim most mutations there
_HEADERISH = st.lists(_MUTATION.map(lambda m: (m[0], m[1] % 1200, m[2])), min_size=1,
                      max_size=4)


@settings(max_examples=400, deadline=1000,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=_HEADERISH | st.lists(_MUTATION, min_size=1, max_size=4))
def test_corrupted_headers_give_a_report_or_one_clean_error(tmp_path, seed, mutations):
    path = tmp_path / "fuzzed.gguf"
    path.write_bytes(mutate(seed, mutations))
    good = tmp_path / "good.gguf"
    if not good.exists():
        good.write_bytes(seed)
    base = read_model_info(str(good))
    tracemalloc.start()
    try:
        info = read_model_info(str(path))
        # the comparison must cope with whatever the header held, on either side
        compare(info, base)
        compare(base, info)
    except ModelFileError as e:
        assert e.message and "\n" not in e.message
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < MEMORY_BOUND


@settings(max_examples=60, deadline=2000,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=_HEADERISH)
def test_the_commands_never_escape_with_a_traceback(tmp_path, seed, mutations):
    good, bad = tmp_path / "good.gguf", tmp_path / "bad.gguf"
    good.write_bytes(seed)
    bad.write_bytes(mutate(seed, mutations))
    for args in (["info", str(bad), "--json", "--tensors"], ["info", str(bad)],
                 ["check-pair", str(good), str(bad), "--json"]):
        # the console entry point in this process (an exception it lets out fails the test):
        # its error boundary turns a ModelFileError into one line and exit 2
        r = cli(*args)
        assert r.returncode in (0, 1) or (
            r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
        ), (args, r.returncode, r.stderr)
