"""Draft heads crafted to crash llama.cpp (issue 55): each a tiny head or target of
scripts/head_models.py with one fact changed that llama.cpp indexes with, asserts on or
divides by. Before these checks each one ended in a GGML_ASSERT (SIGABRT, exit 134) at load
or at the first decode, in `run` and in a server's first completion, while check-pair said
the pair was fine. Now: one line and exit 1 (the pair does not fit) or 2 (the file is
broken), from the headers (and a head's d2t map) before llama.cpp sees either file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import cli, once, specli
from hostile_models import T, _read, copy_gguf

N_VOCAB = 49152  # SmolLM2's, which every tiny model carries


def _d2t(f):
    return lambda name, data: f(data.copy()) if name == "d2t" else data


def _at(a: np.ndarray, i: int, v: int) -> np.ndarray:
    a[i] = v
    return a


def _renamed(src: str, arch: str):
    """The llama target as another architecture that loads the same tensors (its keys
    renamed): one whose llama.cpp graph keeps no layer inputs for a head to read."""
    fields = _read(src)[1]
    old = [k for k in fields if k.startswith("llama.")]
    return dict(set_kv={"general.architecture": (arch, T.STRING, None),
                        **{arch + k[5:]: fields[k] for k in old}}, drop=tuple(old))


def _u32(key: str, v: int) -> dict:
    return dict(set_kv={key: (v, T.UINT32, None)})


# name -> (target, or (target, copy_gguf's changes); head, or (head, changes), or None;
#          --spec-type; exit code; what the line says). What llama.cpp did with each before:
CASES = {
    # ops.cpp: GGML_ASSERT(i1 >= 0 && i1 < ne1), at the first draft
    "d2t id past the vocabulary": ("llama", ("eagle3", dict(tensor=_d2t(
        lambda a: _at(a, 0, N_VOCAB + 848)))), "draft-eagle3", 2,
        "d2t vocabulary map holds token id 50000, outside its 49152-token vocabulary"),
    "d2t id negative": ("llama", ("eagle3", dict(tensor=_d2t(lambda a: _at(a, 0, -1)))),
                        "draft-eagle3", 2, "d2t vocabulary map holds token id -1"),
    # eagle3.cpp:312: GGML_ASSERT(model.d2t->type == GGML_TYPE_I64)
    "d2t of I32": ("llama", ("eagle3", dict(tensor=_d2t(lambda a: a.astype(np.int32)))),
                   "draft-eagle3", 2, "d2t vocabulary map is I32 of shape [45]; llama.cpp reads a "
                   "list of I64 ids"),
    "DFlash d2t past the vocabulary": ("llama", ("dflash", dict(add={"d2t": _at(
        np.arange(N_VOCAB, dtype=np.int64), 5, 60000)})), "draft-dflash", 2,
        "holds token id 60000"),
    "DSpark d2t past the vocabulary": ("llama", ("dspark", dict(add={"d2t": _at(
        np.arange(N_VOCAB, dtype=np.int64), 5, 60000)})), "draft-dspark", 2,
        "holds token id 60000"),
    # eagle3.cpp:313: GGML_ASSERT(model.d2t->ne[0] == n_draft_vocab)
    "d2t without its own output": ("llama", ("eagle3", dict(
        tensor=lambda n, d: None if n == "output.weight" else d)), "draft-eagle3", 1,
        "d2t vocabulary map has 45 entries for the target's output of 49152 rows"),
    # ops.cpp: GGML_ASSERT(i01 >= 0 && i01 < ne01) in get_rows, at the first token past 100
    "own embeddings too short": ("llama", ("eagle3", dict(add={
        "token_embd.weight": np.zeros((100, 64), np.float16)})), "draft-eagle3", 1,
        "own token embeddings have 100 rows for a 49152-token vocabulary"),
    # ggml-backend.cpp: "tensor read out of bounds" (larger); an out-of-bounds read (smaller)
    "wider output states": ("llama", ("eagle3", _u32("eagle3.embedding_length_out", 128)),
                            "draft-eagle3", 2, "embedding_length_out (128) is not its"),
    "narrower output states": ("llama", ("eagle3", _u32("eagle3.embedding_length_out", 32)),
                               "draft-eagle3", 2, "embedding_length_out (32) is not its"),
    # ops.cpp: GGML_ASSERT(n_dims % 2 == 0), GGML_ASSERT(n_dims <= ne0)
    "odd rotary dimensions": ("llama", ("eagle3", _u32("eagle3.rope.dimension_count", 15)),
                              "draft-eagle3", 2, "rope.dimension_count (15) does not fit"),
    "rotary dimensions past the head": ("llama", ("eagle3", _u32(
        "eagle3.rope.dimension_count", 64)), "draft-eagle3", 2,
        "rope.dimension_count (64) does not fit the head size (16)"),
    # dflash.cpp:312: "DSpark draft requires 'dflash.block_size' in GGUF metadata"
    "DSpark without a block size": ("llama", ("dspark", dict(drop=("dflash.block_size",))),
                                    "draft-dspark", 2, "DSpark head without a dflash.block_size"),
    # llama-graph.cpp:1384: "layer input tensor is null"
    "a target that keeps no layer inputs": (("llama", _renamed), "eagle3", "draft-eagle3", 1,
                                            "is qwen2, an architecture whose llama.cpp graph"),
    # llama-context.cpp:1240 (a layer past the target's), as before this issue
    "a layer past the target's": ("llama", ("eagle3", dict(set_kv={
        "eagle3.target_layers": ([0, 2, 9], T.ARRAY, T.INT32)})), "draft-eagle3", 1,
        "reads target layer 9, and "),
    # hy-v3.cpp:253: "MTP block missing nextn.eh_proj", when the MTP context is made
    "more prediction layers than blocks": (("mtp", _u32("hy_v3.nextn_predict_layers", 2)),
                                           None, "draft-mtp", 1,
                                           "says 2, and block 1 has no nextn.eh_proj tensor"),
    # llama-model.cpp:2807: GGML_ASSERT(hparams.is_swa_any())
    "an assistant without sliding-window layers": ("gemma4", ("assistant", dict(set_kv={
        "gemma4-assistant.attention.sliding_window_pattern": ([False, False], T.ARRAY,
                                                              T.BOOL)})), "draft-mtp", 2,
        "sliding_window_pattern marks no sliding-window layer"),
    # ggml.c:1814: GGML_ASSERT(obj_new), DSpark's chain past the graph's room
    "a DSpark block of 1,024": ("llama", ("dspark", _u32("dflash.block_size", 1024)),
                                "draft-dspark", 1, "has a block size of 1024"),
    # metadata of another type: a Python traceback in the checks, or llama.cpp's refusal
    # after check-pair said yes
    "a block size of text": ("llama", ("dspark", dict(set_kv={
        "dflash.block_size": ("x", T.STRING, None)})), "draft-dspark", 2,
        "dflash.block_size is STRING, expected UINT32"),
    "a mask token of text": ("llama", ("dflash", dict(set_kv={
        "tokenizer.ggml.mask_token_id": ("x", T.STRING, None)})), "draft-dflash", 2,
        "mask_token_id is STRING"),
    "target layers of bytes": ("llama", ("eagle3", dict(set_kv={
        "eagle3.target_layers": ([0, 2, 3], T.ARRAY, T.UINT8)})), "draft-eagle3", 2,
        "eagle3.target_layers is ARRAY[UINT8]"),
    "prediction layers of text": (("mtp", dict(set_kv={
        "hy_v3.nextn_predict_layers": ("2", T.STRING, None)})), None, "draft-mtp", 2,
        "hy_v3.nextn_predict_layers is STRING, expected UINT32"),
    "a d2t map of one number": ("llama", ("eagle3", dict(
        tensor=lambda n, d: np.array(7, np.int64) if n == "d2t" else d)), "draft-eagle3", 2,
        "d2t vocabulary map is I64 of shape []"),
    # ggml.c:1797: a view past its source, the target's keys read wider than they are
    "an assistant reading wider keys": ("gemma4", ("assistant", _u32(
        "gemma4-assistant.attention.head_count_kv", 4)), "draft-mtp", 1,
        "reads keys 64 wide from target layer 2, whose keys are 32 wide"),
}


@pytest.fixture(scope="session")
def crafted(heads, model_dir) -> dict[str, tuple[str, str | None]]:
    """Each case's (target, head) files, written once per session."""
    out = model_dir / "hostile-heads"
    with once(model_dir):
        done = out / ".done"
        if done.is_file():
            return {k: tuple(v) for k, v in json.loads(done.read_text()).items()}
        out.mkdir(exist_ok=True)
        files = {}
        for i, (name, (target, head, *_)) in enumerate(CASES.items()):
            files[name] = tuple(_file(heads, spec, out / f"{i}-{role}.gguf")
                                for spec, role in ((target, "target"), (head, "head")))
        done.write_text(json.dumps(files))
        return files


def _file(heads: dict[str, str], spec, path: Path) -> str | None:
    if spec is None or isinstance(spec, str):
        return heads[spec] if spec else None
    base, changes = spec
    return copy_gguf(heads[base], path, **(changes(heads[base], "qwen2")
                                            if callable(changes) else changes))


@pytest.mark.parametrize("case", list(CASES))
def test_a_head_llama_cpp_would_abort_on_is_one_line(crafted, case):
    target, head = crafted[case]
    spec, code, says = CASES[case][2:]
    r = cli("run", "-m", target, *(["-md", head] if head else []), "--spec-type", spec,
            "-p", "The cat", "-n", "8", "--temp", "0")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1 and says in lines[0], r.stderr[-3000:]
    if head is not None:  # check-pair says so too, in its words and in --json
        r = cli("check-pair", target, head)
        assert r.returncode == code and says in r.stdout + r.stderr, r.stdout + r.stderr
        r = cli("check-pair", target, head, "--json")
        assert r.returncode == code
        if code == 1:
            doc = json.loads(r.stdout)
            assert not doc["compatible"] and not doc["head"]["ok"]
            assert says in doc["head"]["problem"]


def test_serve_refuses_a_head_before_it_listens(crafted):
    """A server with such a head started, answered /health, and died at the first
    completion: now it does not start."""
    target, head = crafted["d2t id past the vocabulary"]
    r = specli("serve", "-m", target, "-md", head, "--port", "0", timeout=120)
    assert r.returncode == 2 and "outside its 49152-token vocabulary" in r.stderr, r.stderr
    assert "Uvicorn running" not in r.stderr
