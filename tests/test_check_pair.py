"""`specli check-pair` and `specli info` on real files and synthetic ones (issue 4)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import cli

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "check_pair_gemma_vs_smollm2.json"


def _json(r) -> dict:
    return json.loads(r.stdout)


@pytest.mark.parametrize("derived", ["f16", "f32", "q8_0"])
def test_smollm2_family_pairs_are_compatible(request, q4_1, derived):
    target = request.getfixturevalue(derived)
    r = cli("check-pair", target, q4_1)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verdict: compatible" in r.stdout
    assert "FAIL" not in r.stdout
    doc = _json(cli("check-pair", target, q4_1, "--json"))
    assert doc["compatible"] and doc["rule"] is None
    assert doc["target"]["file_type"] == derived.upper()
    assert doc["target"]["n_params"] == doc["draft"]["n_params"] == 134_515_008
    # same parameters: the size rule of thumb warns, and nothing else does
    assert [w.split(":")[0] for w in doc["warnings"]] == ["parameters"]


def test_smollm2_vs_gemma_is_incompatible_and_names_the_rule(gemma, q4_1):
    r = cli("check-pair", gemma, q4_1)
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last == "verdict: incompatible (vocab-type): vocab types differ: target llama, " \
                   "draft gpt2"
    for field in ("tokenizer", "vocab size", "BOS", "tokens"):
        assert f"FAIL: {field}:" in r.stdout
    assert r.stderr == ""


def _normalized(doc: dict, target: str, draft: str) -> dict:
    text = json.dumps(doc).replace(target, "<target>").replace(draft, "<draft>")
    return json.loads(text)


def test_the_json_report_matches_the_golden_file(gemma, q4_1):
    """The schema and every value, on files that come byte-for-byte from PyPI packages."""
    r = cli("check-pair", gemma, q4_1, "--json")
    assert r.returncode == 1
    doc = _normalized(_json(r), gemma, q4_1)
    assert doc == json.loads(GOLDEN.read_text())


def _keys(v):
    if isinstance(v, dict):
        return {k: _keys(x) for k, x in v.items() if k != "tensor_types"}
    if isinstance(v, list):
        return [_keys(v[0])] if v and isinstance(v[0], dict) else "list"
    return "value"


def test_a_compatible_pair_has_the_same_json_schema(f16, q4_1):
    doc = _json(cli("check-pair", f16, q4_1, "--json"))
    assert _keys(doc) == _keys(json.loads(GOLDEN.read_text()))
    assert [c["field"] for c in doc["checks"]] == [
        "architecture", "parameters", "file type", "file size", "context length", "tokenizer",
        "pre-tokenizer", "vocab size", "BOS", "EOS", "EOT", "PAD", "tokens", "merges",
        "chat template"]


def test_missing_and_invalid_files_exit_2_in_one_line(tmp_path, q4_1):
    r = cli("check-pair", str(tmp_path / "nope.gguf"), q4_1)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"error: model file not found: {tmp_path / 'nope.gguf'}"]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 20)
    r = cli("check-pair", q4_1, str(bad), "--json")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1
    assert "is not a valid GGUF file" in r.stderr and "Traceback" not in r.stderr


def test_a_download_cut_short_is_caught_from_the_tensor_index(tmp_path, q4_1):
    cut = tmp_path / "partial.gguf"
    cut.write_bytes(Path(q4_1).read_bytes()[:5_000_000])
    r = cli("check-pair", q4_1, str(cut))
    assert r.returncode == 2
    assert "tensor data ends at byte" in r.stderr and "truncated" in r.stderr


# -- synthetic files: each warning alone ------------------------------------------------------

def write(path: Path, arch="llama", pre="smollm", template: str | None = None,
          n_params=1000, **kv) -> str:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([f"tok{i}" for i in range(300)])
    w.add_token_merges(["t o"])  # a BPE vocabulary llama.cpp can load has merges
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if template is not None:
        w.add_chat_template(template)
    for key, value in kv.items():
        w.add_uint32(key, value)
    w.add_tensor("weight", np.zeros(n_params, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("draft_kw,warned,why", [
    ({"n_params": 50}, [], "5% of the target"),
    ({"n_params": 200}, [], "20% of the target"),
    ({"n_params": 201}, ["parameters"], "the rule of thumb is a draft of 5%-20%"),
    ({"n_params": 50, "pre": "qwen2"}, ["pre-tokenizer"], "different pre-tokenizers"),
    ({"n_params": 50, "template": "{{ x }}"}, ["chat template"], "chat templates differ"),
    ({"n_params": 50, "arch": "llama4"}, ["architecture"], "same family (llama)"),
    ({"n_params": 50, "arch": "qwen2"}, ["architecture"], "different architecture families"),
])
def test_warnings_do_not_fail(tmp_path, draft_kw, warned, why):
    target = write(tmp_path / "t.gguf", template="{{ y }}" if "template" in draft_kw else None)
    draft = write(tmp_path / "d.gguf", **draft_kw)
    r = cli("check-pair", target, draft, "--json")
    assert r.returncode == 0, r.stderr
    doc = _json(r)
    assert [w.split(":")[0] for w in doc["warnings"]] == warned
    notes = " ".join(c["note"] for c in doc["checks"])
    assert why in notes


def test_a_single_rule_failure_names_the_rule_on_the_cli(tmp_path):
    target = write(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "d.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([f"tok{i}" for i in range(300)])
    w.add_token_merges(["t o"])  # a BPE vocabulary llama.cpp can load has merges
    w.add_bos_token_id(1)
    w.add_eos_token_id(7)
    w.add_add_eos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = cli("check-pair", target, str(tmp_path / "d.gguf"))
    assert r.returncode == 1
    assert "verdict: incompatible (eos): EOS differs" in r.stdout


# -- --probe -----------------------------------------------------------------------------------

def test_probe_measures_acceptance_and_recommends(f16, q4_1):
    r = cli("check-pair", f16, q4_1, "--probe", "-n", "16", "--draft", "4",
               "--json")
    assert r.returncode == 0, r.stderr
    p = _json(r)["probe"]
    assert [row["kind"] for row in p["rows"]] == ["code", "structured", "chat"]
    assert all(row["identical"] for row in p["rows"])  # F16 target: greedy output is exact
    assert 0 < p["accept_rate"] <= 1 and p["speedup"] > 0
    assert 1 <= p["suggested_draft"] <= 4
    assert len(p["accept_rate_per_pos"]) <= 4
    # the recommendation follows from the figures reported beside it
    prefix = f"worth it: use --draft {p['suggested_draft']} " if p["worth_it"] else \
        "not worth it on this machine "
    assert p["recommendation"].startswith(prefix)
    assert f"measured {p['speedup']:.2f}x at --draft 4" in p["recommendation"]
    text = cli("check-pair", f16, q4_1, "--probe", "-n", "8", "--draft", "2")
    assert text.returncode == 0
    assert "recommendation: " in text.stdout and "speedup" in text.stdout


def test_probe_is_not_run_on_an_incompatible_pair(gemma, q4_1):
    r = cli("check-pair", gemma, q4_1, "--probe", "--json")
    assert r.returncode == 1 and _json(r)["probe"] is None


# -- specli info -----------------------------------------------------------------------------

def test_info_lines_grep_like_llama_gguf_info(q4_1):
    r = cli("info", q4_1)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "tokenizer.ggml.model = gpt2" in lines
    assert "tokenizer.ggml.pre = smollm" in lines
    assert any(line.startswith("tokenizer.ggml.tokens = [STRING x 49152]") for line in lines)
    assert any(line.startswith("tensors (272, 134,515,008 parameters") for line in lines)


def test_info_json_and_tensor_list(gemma):
    doc = _json(cli("info", gemma, "--json", "--tensors"))
    assert doc["summary"]["architecture"] == "gemma3"
    assert doc["summary"]["size_label"] == "270M" and doc["summary"]["file_type"] == "Q4_K_M"
    assert doc["summary"]["tokenizer"]["n_vocab"] == 262_144
    assert doc["summary"]["tokenizer"]["chat_template"] is False
    tokens = doc["metadata"]["tokenizer.ggml.tokens"]
    assert tokens["count"] == 262_144 and tokens["preview"] == ["<pad>", "<eos>", "<bos>"]
    t = doc["tensors"]
    assert t["count"] == len(t["list"]) == 236
    assert sum(x["bytes"] for x in t["list"]) == t["bytes"]
    assert t["types"]["Q4_K"]["count"] == 27


def test_info_on_a_bad_file_is_one_line(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a model")
    r = cli("info", str(tmp_path / "x.gguf"))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "wrong magic" in r.stderr


# -- crafted metadata: wrong types, markup, control characters, layouts gguf.cpp refuses ----

STRING, ARRAY, UINT32, FLOAT32 = 8, 9, 4, 6


def _s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _tokens(n: int = 16) -> bytes:
    return _kv("tokenizer.ggml.tokens", ARRAY,
               struct.pack("<IQ", STRING, n) + b"".join(_s(f"t{i}") for i in range(n)))


MERGES = _kv("tokenizer.ggml.merges", ARRAY, struct.pack("<IQ", STRING, 1) + _s("t 1"))


def raw_gguf(path: Path, *kvs: bytes, tensors: bytes = b"", n_tensors: int = 0,
             data: bytes = b"") -> str:
    body = b"".join(kvs)
    head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs)) + body + tensors
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + data)
    return str(path)


ARCH = _kv("general.architecture", STRING, _s("llama"))
GPT2 = _kv("tokenizer.ggml.model", STRING, _s("gpt2"))


@pytest.mark.parametrize("kvs,needle", [
    ((ARCH, GPT2, _kv("tokenizer.ggml.tokens", UINT32, struct.pack("<I", 5))),
     "tokenizer.ggml.tokens is UINT32, expected ARRAY[STRING]"),
    ((ARCH, GPT2, _tokens(), _kv("tokenizer.chat_template", UINT32, struct.pack("<I", 1))),
     "tokenizer.chat_template is UINT32"),
    ((_kv("general.architecture", UINT32, struct.pack("<I", 1)), GPT2, _tokens()),
     "general.architecture is UINT32"),
    ((ARCH, GPT2, _tokens(), _kv("tokenizer.ggml.bos_token_id", FLOAT32,
                                 struct.pack("<f", float("nan")))),
     "tokenizer.ggml.bos_token_id is FLOAT32"),
    ((ARCH, GPT2, _kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", ARRAY, 1)
                      + struct.pack("<IQ", STRING, 0))), "an array of arrays"),
    ((ARCH, _kv("", STRING, _s("x"))), "an empty key"),
])
def test_wrongly_typed_or_refused_metadata_is_exit_2(tmp_path, q4_1, kvs, needle):
    bad = raw_gguf(tmp_path / "bad.gguf", *kvs)
    for args in (["check-pair", q4_1, bad], ["check-pair", bad, q4_1, "--json"],
                 ["info", bad], ["info", bad, "--json"]):
        r = cli(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr


def test_big_endian_files_are_refused_as_llama_cpp_refuses_them(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "be.gguf"), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_tokenizer_model("gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = cli("info", str(tmp_path / "be.gguf"))
    assert r.returncode == 2 and "big-endian" in r.stderr


def test_tensors_must_follow_each_other_as_gguf_cpp_requires(tmp_path):
    def tensor(name: str, offset: int) -> bytes:
        return _s(name) + struct.pack("<I", 1) + struct.pack("<Q", 8) \
            + struct.pack("<IQ", 0, offset)  # 8 x F32 = 32 bytes
    ok = raw_gguf(tmp_path / "ok.gguf", ARCH, GPT2, _tokens(),
                  tensors=tensor("a", 0) + tensor("b", 32), n_tensors=2, data=b"\0" * 64)
    overlap = raw_gguf(tmp_path / "overlap.gguf", ARCH, GPT2, _tokens(),
                       tensors=tensor("a", 0) + tensor("b", 0), n_tensors=2, data=b"\0" * 64)
    assert cli("info", ok).returncode == 0
    r = cli("info", overlap)
    assert r.returncode == 2 and "tensor 'b' is at offset 0, expected 32" in r.stderr


def test_metadata_is_text_not_markup_nor_terminal_control(tmp_path, q4_1):
    evil = raw_gguf(tmp_path / "evil.gguf", _kv("general.architecture", STRING, _s("[/]")),
                    _kv("general.name", STRING, _s("x\x1b]0;owned\x07y")), GPT2, _tokens(),
                    MERGES)
    r = cli("check-pair", evil, evil)
    assert r.returncode == 0, r.stderr
    assert "[/]" in r.stdout
    r = cli("info", evil)
    assert r.returncode == 0 and "\x1b" not in r.stdout
    assert "general.name = x\\x1b]0;owned\\x07y" in r.stdout


def test_files_without_a_tokenizer_are_not_a_pair(tmp_path):
    a = raw_gguf(tmp_path / "a.gguf", ARCH)
    r = cli("check-pair", a, a)
    assert r.returncode == 1
    assert "no tokenizer in the target and draft" in r.stdout


def test_special_ids_outside_the_vocabulary_fall_back_as_in_llama_cpp(tmp_path):
    from specli.pairing import read_tokenizer

    p = raw_gguf(tmp_path / "ids.gguf", ARCH, GPT2, _tokens(16),
                 _kv("tokenizer.ggml.eos_token_id", UINT32, struct.pack("<I", 99999)),
                 _kv("tokenizer.ggml.bos_token_id", UINT32, struct.pack("<I", 3)))
    t = read_tokenizer(p)
    assert t.bos_id == 3
    assert t.eos_id == 11  # the file's 99999 is ignored; gpt2's default 11 is in range
