"""llama.cpp's pairing rules one at a time, on synthetic GGUF headers written with gguf's own
GGUFWriter (issue 4's tests): each variant breaks exactly one rule."""

from __future__ import annotations

import gguf
import pytest

from specli.pairing import check_pair, read_tokenizer

N_VOCAB = 300


def write(path, n_vocab=N_VOCAB, model="gpt2", bos=1, eos=2, add_bos=False, add_eos=False,
          rename: dict[int, str] | None = None) -> str:
    tokens = [f"tok{i}" for i in range(n_vocab)]
    for i, text in (rename or {}).items():
        tokens[i] = text
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture
def target(tmp_path):
    return read_tokenizer(write(tmp_path / "target.gguf", add_bos=True))


@pytest.mark.parametrize("variant,rule", [
    ({"add_bos": True}, None),
    ({"add_bos": True, "n_vocab": N_VOCAB + 128}, None),
    ({"add_bos": True, "rename": {4: "other"}}, None),  # ids below 5 are not compared
    ({"add_bos": True, "model": "llama"}, "vocab-type"),
    ({"add_bos": False}, "bos"),
    ({"add_bos": True, "bos": 3}, "bos"),
    ({"add_bos": True, "add_eos": True}, "eos"),
    ({"add_bos": True, "n_vocab": N_VOCAB + 129}, "vocab-size"),
    ({"add_bos": True, "rename": {5: "other"}}, "token-text"),
])
def test_each_rule_alone(tmp_path, target, variant, rule):
    draft = read_tokenizer(write(tmp_path / "draft.gguf", **variant))
    verdict = check_pair(target, draft)
    assert verdict.rule == rule and verdict.ok == (rule is None), verdict.message
    if rule == "token-text":
        assert "token 5" in verdict.message and "'other'" in verdict.message
