"""One pairing policy, llama.cpp's rules, from GGUF metadata alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specli.errors import IncompatiblePairError, ModelFileError
from specli.pairing import TokenizerInfo, check_pair, ensure_compatible, read_tokenizer

BASE = TokenizerInfo(path="t", architecture="llama", model="gpt2", pre="smollm",
                     tokens=tuple(f"t{i}" for i in range(300)), bos_id=1, eos_id=2,
                     add_bos=False, add_eos=False)


@pytest.mark.parametrize("change,rule", [
    ({"model": "llama"}, "vocab-type"),
    ({"add_bos": True}, "bos"),
    ({"eos_id": 7, "add_eos": True}, "eos"),
    ({"tokens": BASE.tokens[:100]}, "vocab-size"),
    ({"tokens": (*BASE.tokens[:42], "other", *BASE.tokens[43:])}, "token-text"),
])
def test_each_rule_names_itself(change, rule):
    v = check_pair(BASE, replace(BASE, **change))
    assert not v.ok and v.rule == rule
    if rule == "token-text":
        assert "token 42" in v.message and "'other'" in v.message


def test_what_llama_cpp_tolerates():
    assert check_pair(BASE, replace(BASE, tokens=BASE.tokens[:200])).ok  # 100 <= 128 apart
    assert check_pair(BASE, replace(BASE, tokens=("x",) * 5 + BASE.tokens[5:])).ok  # ids < 5
    assert check_pair(BASE, replace(BASE, bos_id=9)).ok  # BOS id only matters when added


def test_real_family_is_compatible_and_gemma_is_not(f32, q4_1, gemma):
    assert check_pair(read_tokenizer(f32), read_tokenizer(q4_1)).ok
    with pytest.raises(IncompatiblePairError) as e:
        ensure_compatible(f32, gemma)
    assert e.value.rule == "vocab-type" and e.value.exit_code == 1


def test_unreadable_files(tmp_path):
    with pytest.raises(ModelFileError):
        read_tokenizer(str(tmp_path / "none.gguf"))
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(ModelFileError):
        read_tokenizer(str(tmp_path / "x.gguf"))


def write_gguf(path, **kv) -> str:
    """A header-only GGUF written by the gguf package itself."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(kv.pop("model"))
    if "pre" in kv:
        w.add_tokenizer_pre(kv.pop("pre"))
    w.add_token_list(kv.pop("tokens", [f"t{i}" for i in range(50)]))
    for key, value in kv.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_absent_keys_take_llama_cpp_defaults(tmp_path):
    spm = read_tokenizer(write_gguf(tmp_path / "a.gguf", model="llama"))
    assert (spm.bos_id, spm.eos_id, spm.add_bos, spm.add_eos) == (1, 2, True, False)
    bpe = read_tokenizer(write_gguf(tmp_path / "b.gguf", model="gpt2", pre="llama-bpe",
                                    eos_token_id=7))
    assert (bpe.bos_id, bpe.eos_id, bpe.add_bos, bpe.add_eos) == (11, 7, True, False)
    # a BPE file saying nothing about BOS and one saying add_bos=false pair like in llama.cpp
    plain = read_tokenizer(write_gguf(tmp_path / "c.gguf", model="gpt2", pre="qwen2"))
    explicit = read_tokenizer(write_gguf(tmp_path / "d.gguf", model="gpt2", pre="qwen2",
                                         add_bos_token=False))
    assert check_pair(plain, explicit).ok
    assert check_pair(spm, bpe).rule == "vocab-type"
