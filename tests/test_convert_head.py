"""`specli convert-head`: a published EAGLE-3 checkpoint (safetensors) into the GGUF llama.cpp
loads, against a GGUF target. Each layout is written from the tiny random-weight head of
scripts/head_models.py, converted, and compared with that head written directly as GGUF:
the same tensors, the same keys, the same drafts step for step. Bad checkpoints are one line
and exit 2, with nothing written."""

from __future__ import annotations

import json
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import cli
from test_cli import one_line_error

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import head_models  # noqa: E402
from head_models import DFLASH_LAYOUTS, EAGLE3_LAYOUTS  # noqa: E402

# what the converter writes beyond what a hand-written head carries (llama.cpp's converter
# writes them too: general.*, the vocabulary size, the rope width, the variant flags)
CONVERTER_KEYS = {"general.type", "general.file_type", "general.quantization_version",
                  "eagle3.vocab_size", "eagle3.rope.dimension_count",
                  "eagle3.norm_before_residual", "eagle3.norm_before_fc",
                  # a llama config's head width, which transformers' LlamaConfig derives
                  "eagle3.attention.key_length", "eagle3.attention.value_length"}


def _direct(tmp: Path, q4_1: str, layout: str) -> str:
    return head_models.layout_head(tmp / f"direct-{layout}.gguf", q4_1, layout)


@pytest.fixture(scope="module")
def made(tmp_path_factory, q4_1):
    """layout -> (the head written directly, its checkpoint), each made once."""
    where, done = tmp_path_factory.mktemp("eagle3"), {}

    def make(layout: str) -> tuple[str, Path]:
        if layout not in done:
            direct = _direct(where, q4_1, layout)
            done[layout] = direct, head_models.eagle3_checkpoint(
                where / f"ckpt-{layout}", direct, layout, q4_1)
        return done[layout]
    return make


@pytest.fixture
def checkpoint(made, tmp_path):
    """(the direct head, a copy of its checkpoint this test may change)."""
    def copy(layout: str) -> tuple[str, Path]:
        direct, ckpt = made(layout)
        return direct, Path(shutil.copytree(ckpt, tmp_path / ckpt.name))
    return copy


def _fields(path: str) -> tuple[dict, dict]:
    return head_models.read_gguf(path)


def _same_keys(direct: str, converted: str, extra: set[str]) -> tuple[dict, dict]:
    """Every key of the direct head in the converted one with its value, no other key but
    the converter's own extras, the same tensor names: both files' tensors."""
    kv_d, ts_d = _fields(direct)
    kv_c, ts_c = _fields(converted)
    for k, v in kv_d.items():
        if k != "general.name":
            assert kv_c.get(k) == pytest.approx(v) if isinstance(v, float) else kv_c.get(k) == v, k
    assert set(kv_c) - set(kv_d) <= extra
    assert set(ts_c) == set(ts_d)
    return ts_d, ts_c


@pytest.mark.parametrize("layout", sorted(EAGLE3_LAYOUTS))
def test_each_layout_converts_to_the_head_written_directly(tmp_path, checkpoint, heads, layout):
    direct, ckpt = checkpoint(layout)
    out = tmp_path / "head.gguf"
    r = cli("convert-head", str(ckpt), "-m", heads["llama"], "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["type"] == "draft-eagle3" and doc["architecture"] == EAGLE3_LAYOUTS[layout]["arch"]
    ts_d, ts_c = _same_keys(direct, str(out), CONVERTER_KEYS)
    bf16 = EAGLE3_LAYOUTS[layout].get("dtype") == "bf16"
    for name, (kind, a) in ts_d.items():
        got_kind, got = ts_c[name]
        if bf16 and kind == "F16":  # matrices stay the checkpoint's bf16 (--outtype auto)
            assert got_kind == "BF16", name
            want = a.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
            assert np.array_equal(got.view(np.uint16).reshape(want.shape), want), name
        else:  # norms: f32 in the GGUF, whatever the checkpoint's type
            assert got_kind == kind, name
            if bf16 and kind == "F32":
                a = a.astype(ml_dtypes.bfloat16).astype(np.float32)
            assert np.array_equal(got, a), name


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_a_converted_head_drafts_as_the_direct_one(tmp_path, checkpoint, heads, layout):
    """The same greedy text and the same acceptance, step for step (norm_before_residual
    and the head's own embeddings included)."""
    direct, ckpt = checkpoint(layout)
    out = tmp_path / "head.gguf"
    assert cli("convert-head", str(ckpt), "-m", heads["llama"], "-o", str(out)).returncode == 0
    runs = []
    for head in (direct, str(out)):
        r = cli("run", "-m", heads["llama"], "-md", head, "--spec-type", "draft-eagle3",
                "-p", "The history of the city is", "-n", "40", "--temp", "0", "--draft", "4",
                "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        runs.append((doc["text"], doc["stats"]["n_drafted"], doc["stats"]["n_accept"]))
    assert runs[0] == runs[1]
    assert runs[0][1] > 0


def test_outtype(tmp_path, checkpoint, heads):
    _, ckpt = checkpoint("specforge")
    out = tmp_path / "head-f32.gguf"
    r = cli("convert-head", str(ckpt), "-m", heads["llama"], "-o", str(out), "--outtype", "f32")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out)
    assert "LlamaForCausalLMEagle3 -> draft-eagle3" in r.stderr
    _, ts = _fields(str(out))
    assert {k for k, _ in ts.values()} == {"F32", "I64"}
    one_line_error(cli("convert-head", str(ckpt), "-m", heads["llama"], "-o", str(out),
                       "--outtype", "q2_k"), 2, "--outtype")


# --- bad input: one line, exit 2, nothing written ------------------------------------------

def _refused(tmp_path: Path, ckpt: Path, target: str, *needles: str) -> None:
    out = tmp_path / "out" / "head.gguf"
    out.parent.mkdir(exist_ok=True)
    one_line_error(cli("convert-head", str(ckpt), "-m", target, "-o", str(out)), 2, *needles)
    assert list(out.parent.iterdir()) == []


def _config(ckpt: Path, **change) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    for k, v in change.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (ckpt / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("change,needles", [
    ({"architectures": ["MambaForCausalLM"]}, ("MambaForCausalLM",)),
    ({"architectures": ["LingDSparkModel"]}, ("LingDSparkModel", "does not convert")),
    ({"architectures": ["DFlashDraftModel"]}, ("DFlashDraftModel", "target_layer_ids")),
    ({"architectures": None}, ("architectures",)),
    ({"target_hidden_size": 128}, ("target width of 128", "is 64")),
    ({"vocab_size": 32000}, ("32,000",)),
    ({"eagle_aux_hidden_state_layer_ids": [0, 2, 9]}, ("reads target layer 9", "layers 0 to 3")),
    ({"eagle_aux_hidden_state_layer_ids": [0, 2]}, ("three",)),
    ({"hidden_size": "64"}, ("hidden_size",)),
    ({"hidden_size": 10**30}, ("hidden_size",)),
    ({"rms_norm_eps": float("nan")}, ("rms_norm_eps",)),
    ({"rms_norm_eps": 1e39}, ("rms_norm_eps",)),  # past float32: the writer would overflow
    ({"rope_theta": 10**400}, ("rope_theta",)),
    ({"rope_scaling": {"full_attention": 1}}, ("full_attention",)),
    ({"head_dim": 5}, ("head width of 5",)),
    ({"num_hidden_layers": 2}, ("2 layers",)),
    ({"intermediate_size": 96}, ("ffn_gate", "[96, 64]")),
    ({"rope_scaling": {"rope_type": "mrope-xyz"}}, ("mrope-xyz",)),
    ({"norm_before_fc": True}, ("enc.output_norm",)),
])
def test_a_checkpoint_that_does_not_fit_is_one_line(tmp_path, checkpoint, heads, change,
                                                      needles):
    _, ckpt = checkpoint("specforge")
    _config(ckpt, **change)
    _refused(tmp_path, ckpt, heads["llama"], *needles)


def test_a_head_for_another_target_is_one_line(tmp_path, checkpoint, heads, gemma):
    _, ckpt = checkpoint("specforge")
    _refused(tmp_path, ckpt, gemma, "262,144", "trained for another target")


def _raw_safetensors(path: Path, header: dict | bytes, data: bytes = b"") -> None:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


@pytest.mark.parametrize("hostile", ["truncated", "huge-shape", "offsets-out", "overlap",
                                     "header-100mb", "not-json", "empty"])
def test_a_hostile_safetensors_file_is_one_line(tmp_path, checkpoint, heads, hostile):
    _, ckpt = checkpoint("specforge")
    st = ckpt / "model.safetensors"
    if hostile == "truncated":
        st.write_bytes(st.read_bytes()[:-1000])
    elif hostile == "huge-shape":
        _raw_safetensors(st, {"fc.weight": {"dtype": "F16", "shape": [1 << 40, 1 << 40],
                                            "data_offsets": [0, 8]}}, b"\0" * 8)
    elif hostile == "offsets-out":
        _raw_safetensors(st, {"fc.weight": {"dtype": "F16", "shape": [2, 2],
                                            "data_offsets": [0, 1 << 30]}}, b"\0" * 8)
    elif hostile == "overlap":
        _raw_safetensors(st, {"a": {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 8]},
                              "b": {"dtype": "F16", "shape": [2, 2], "data_offsets": [4, 12]}},
                         b"\0" * 12)
    elif hostile == "header-100mb":  # the length field claims a 100 MB header
        st.write_bytes(struct.pack("<Q", 100_000_001) + b"{}")
    elif hostile == "not-json":
        _raw_safetensors(st, b"\xff\xfe not json at all")
    else:
        st.write_bytes(b"")
    _refused(tmp_path, ckpt, heads["llama"], "model.safetensors")


@pytest.mark.parametrize("hostile", ["list", "big", "deep", "binary", "missing"])
def test_a_hostile_config_is_one_line(tmp_path, checkpoint, heads, hostile):
    _, ckpt = checkpoint("specforge")
    cfg = ckpt / "config.json"
    if hostile == "list":
        cfg.write_text("[1, 2, 3]")
    elif hostile == "big":
        cfg.write_text('{"pad": "' + "x" * (5 << 20) + '"}')
    elif hostile == "deep":
        cfg.write_text("[" * 200_000 + "]" * 200_000)
    elif hostile == "binary":
        cfg.write_bytes(b"\x00\xff\xfe" * 100)
    else:
        cfg.unlink()
    _refused(tmp_path, ckpt, heads["llama"], "config.json")


def test_a_symlink_out_of_the_checkpoint_is_refused(tmp_path, checkpoint, heads):
    _, ckpt = checkpoint("specforge")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (ckpt / "model.safetensors").rename(elsewhere / "model.safetensors")
    (ckpt / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    _refused(tmp_path, ckpt, heads["llama"], "outside the checkpoint")
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"fc.weight": "../elsewhere/model.safetensors"}}))
    _refused(tmp_path, ckpt, heads["llama"], "not a safetensors file beside it")


def test_a_pickle_checkpoint_is_refused_unopened(tmp_path, checkpoint, heads):
    _, ckpt = checkpoint("specforge")
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04 not unpickled")
    _refused(tmp_path, ckpt, heads["llama"], "pytorch_model.bin", "pickle")


def test_a_disk_that_fills_leaves_nothing(tmp_path, checkpoint, heads):
    """A write that fails part way (here the process's file-size limit, EFBIG, as ENOSPC
    would) is one line, and neither the output nor its temporary file is left."""
    _, ckpt = checkpoint("speculators")  # its own embeddings: 6 MB
    out = tmp_path / "out" / "head.gguf"
    out.parent.mkdir()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    r = subprocess.run([sys.executable, "-m", "specli", "convert-head", str(ckpt), "-m",
                        heads["llama"], "-o", str(out)], capture_output=True, text=True,
                       preexec_fn=limit, timeout=120)
    one_line_error(r, 2, "cannot write", str(out))
    assert list(out.parent.iterdir()) == []


# --- from the hub: -hfd and download --eagle3 on a safetensors repository ----------------

@pytest.fixture
def ckpt_hub(made):
    from fakehub import FakeHub

    _, ckpt = made("specforge")
    h = FakeHub()
    h.add("acme/tiny-eagle3", {"config.json": (ckpt / "config.json").read_bytes(),
                               "model.safetensors": (ckpt / "model.safetensors").read_bytes(),
                               "README.md": b"# a head\n", "tokenizer.json": b"{}",
                               "training_args.bin": b"not read"})
    yield h
    h.close()


def _env(h, tmp_path: Path, offline: bool = False) -> dict:
    from test_heads import hub_env

    return {**hub_env(h, tmp_path), "SPECLI_CACHE_DIR": str(tmp_path / "specli"),
            "HF_HUB_OFFLINE": "1" if offline else "0"}


def _fetched(h) -> set[str]:
    return {p.rsplit("/", 1)[-1] for m, p, _ in h.requests if m == "GET" and "/resolve/" in p}


def test_hfd_converts_a_safetensors_head_once_and_reuses_it_offline(ckpt_hub, tmp_path,
                                                                    heads):
    from conftest import specli

    args = ["run", "-m", heads["llama"], "-hfd", "acme/tiny-eagle3", "--spec-type",
            "draft-eagle3", "-p", "The history of the city is", "-n", "8", "--temp", "0"]
    r = specli(*args, env=_env(ckpt_hub, tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "statistics draft-eagle3: " in r.stderr and "converted acme/tiny-eagle3@" in r.stderr
    assert _fetched(ckpt_hub) == {"config.json", "model.safetensors"}  # nothing else
    # listed twice: for GGUF sidecars, then as a checkpoint (the listing is passed on)
    assert sum("/tree/" in p for _, p, _ in ckpt_hub.requests) == 2
    made_files = list((tmp_path / "specli" / "heads" / "acme--tiny-eagle3").glob("*.gguf"))
    assert len(made_files) == 1
    stamp = made_files[0].stat().st_mtime_ns
    ckpt_hub.requests.clear()
    r2 = specli(*args, env=_env(ckpt_hub, tmp_path, offline=True), timeout=120)
    assert r2.returncode == 0, r2.stderr
    assert "converted" not in r2.stderr and ckpt_hub.requests == []
    assert made_files[0].stat().st_mtime_ns == stamp
    assert r2.stdout == r.stdout


def test_download_eagle3_converts_against_the_target(ckpt_hub, tmp_path, heads):
    from conftest import specli

    env = _env(ckpt_hub, tmp_path)
    r = specli("download", "--eagle3", "acme/tiny-eagle3", env=env, timeout=120)
    one_line_error(r, 2, "-m")
    r = specli("download", "--dflash", "acme/tiny-eagle3", "-m", heads["llama"], env=env,
               timeout=120)
    one_line_error(r, 2, "acme/tiny-eagle3 is an EAGLE-3 head (draft-eagle3), not draft-dflash")
    r = specli("download", "--eagle3", "acme/tiny-eagle3", "-m", heads["llama"], "--json",
               env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    path = Path(json.loads(r.stdout)["sidecars"]["eagle3"])
    assert path.is_relative_to(tmp_path / "specli" / "heads") and path.is_file()


# --- info and check-pair on a checkpoint, before any conversion ----------------------------

def test_info_and_check_pair_read_a_checkpoint(made, heads, gemma):
    _, ckpt = made("speculators")
    r = cli("info", str(ckpt))
    assert r.returncode == 0, r.stderr
    assert ("draft head: draft-eagle3: Eagle3Speculator, width 64, target layers 0, 2, 3, "
            "target width 64, 45 of 49,152 tokens through d2t, norm_before_residual, its own "
            "token embeddings") in r.stdout
    assert "layers.0.self_attn.q_proj.weight" in r.stdout
    doc = json.loads(cli("info", str(ckpt), "--json").stdout)["checkpoint"]
    assert doc["type"] == "draft-eagle3" and doc["target_layers"] == [0, 2, 3]
    r = cli("check-pair", heads["llama"], str(ckpt))
    assert r.returncode == 0, r.stderr
    assert "verdict: compatible" in r.stdout
    r = cli("check-pair", gemma, str(ckpt), "--json")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["compatible"] is False and "262,144" in doc["message"]
    r = cli("check-pair", heads["llama"], str(ckpt.parent / "nowhere"))
    assert r.returncode == 2


# --- DFlash and DSpark ----------------------------------------------------------------------

DFLASH_KEYS = {"general.type", "general.file_type", "general.quantization_version",
               "dflash.sample_from_anchor", "dflash.has_confidence_head",
               "dflash.attention.key_length", "dflash.attention.value_length"}


@pytest.fixture(scope="module")
def dflash_made(tmp_path_factory, q4_1):
    where, done = tmp_path_factory.mktemp("dflash"), {}

    def make(layout: str) -> tuple[str, Path]:
        if layout not in done:
            direct = _direct(where, q4_1, layout)
            done[layout] = direct, head_models.dflash_checkpoint(
                where / f"ckpt-{layout}", direct, layout, q4_1)
        return done[layout]
    return make


@pytest.mark.parametrize("layout", sorted(DFLASH_LAYOUTS))
def test_each_dflash_layout_converts_to_the_head_written_directly(tmp_path, dflash_made, heads,
                                                                  layout):
    direct, ckpt = dflash_made(layout)
    out = tmp_path / "head.gguf"
    r = cli("convert-head", str(ckpt), "-m", heads["llama"], "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["type"] == ("draft-dflash" if layout == "dflash"
                                            else "draft-dspark")
    ts_d, ts_c = _same_keys(direct, str(out), DFLASH_KEYS)
    for name, (kind, a) in ts_d.items():
        assert ts_c[name][0] == kind and np.array_equal(ts_c[name][1], a), name


@pytest.mark.parametrize("layout", ["dflash", "dspark-speculators"])
def test_a_converted_dflash_head_drafts_as_the_direct_one(tmp_path, dflash_made, heads, layout):
    direct, ckpt = dflash_made(layout)
    out = tmp_path / "head.gguf"
    assert cli("convert-head", str(ckpt), "-m", heads["llama"], "-o", str(out)).returncode == 0
    kind = "draft-dflash" if layout == "dflash" else "draft-dspark"
    runs = []
    for head in (direct, str(out)):
        r = cli("run", "-m", heads["llama"], "-md", head, "--spec-type", kind,
                "-p", "The history of the city is", "-n", "40", "--temp", "0", "--draft", "4",
                "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        runs.append((doc["text"], doc["stats"]["n_drafted"], doc["stats"]["n_accept"]))
    assert runs[0] == runs[1] and runs[0][1] > 0


@pytest.mark.parametrize("change,needles", [
    ({"dflash_config": {"mask_token_id": 10**9, "target_layer_ids": [0, 2]}}, ("mask token",)),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 7]}},
     ("reads target layer 8",)),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2],
                        "conv_kernel_size": 4}}, ("conv_kernel_size",)),
    ({"hidden_size": 128}, ("target width of 128",)),
    ({"dflash_config": {"target_layer_ids": [0, 2]}}, ("mask token",)),
    ({"final_logit_softcapping": "abc"}, ("final_logit_softcapping",)),
    ({"use_sliding_window": True, "sliding_window": 64, "layer_types": 5}, ("layer_types",)),
    ({"architectures": ["Gemma4DSparkModel"]}, ("Gemma4DSparkModel", "not convert")),
    # a qwen3 config without head_dim: transformers' (and llama.cpp's converter's) 128
    ({"head_dim": None}, ("attn_q.weight is [64, 64]", "expects [512, 64]")),
])
def test_a_dflash_checkpoint_that_does_not_fit_is_one_line(tmp_path, dflash_made, heads,
                                                           change, needles):
    _, made_ckpt = dflash_made("dflash")
    ckpt = Path(shutil.copytree(made_ckpt, tmp_path / "ckpt"))
    _config(ckpt, **change)
    _refused(tmp_path, ckpt, heads["llama"], *needles)


def test_a_mask_embedding_pickle_is_refused(tmp_path, dflash_made, heads):
    _, made_ckpt = dflash_made("dflash")
    ckpt = Path(shutil.copytree(made_ckpt, tmp_path / "ckpt"))
    (ckpt / "mask_embedding.pt").write_bytes(b"PK\x03\x04 not unpickled")
    _refused(tmp_path, ckpt, heads["llama"], "mask_embedding.pt", "pickle")


def test_the_output_is_never_an_input(tmp_path, checkpoint, heads):
    _, ckpt = checkpoint("specforge")
    target = tmp_path / "target.gguf"
    shutil.copyfile(heads["llama"], target)
    before = target.read_bytes()
    one_line_error(cli("convert-head", str(ckpt), "-m", str(target), "-o", str(target)), 2,
                   "is an input")
    assert target.read_bytes() == before


def test_a_head_preset_fetches_the_target_and_converts_the_head(made, heads, tmp_path):
    """`download --pair qwen3-4b-eagle3`: the target GGUF, then the published head converted
    against it (the preset's repositories played by the tiny llama and the head made for it);
    --list-pairs shows the head presets beside the draft pairs."""
    from conftest import specli
    from fakehub import FakeHub

    from specli import hub

    p = hub.pair("qwen3-4b-eagle3")
    assert p.head == "draft-eagle3" and p.draft.repo == "AngelSlim/Qwen3-4B_eagle3"
    _, ckpt = made("specforge")
    h = FakeHub()
    try:
        h.add(p.target.repo, {"Qwen3-4B-Q4_K_M.gguf": Path(heads["llama"]).read_bytes()})
        h.add(p.draft.repo, {"config.json": (ckpt / "config.json").read_bytes(),
                             "model.safetensors": (ckpt / "model.safetensors").read_bytes()})
        env = _env(h, tmp_path)
        r = specli("download", "--pair", "qwen3-4b-eagle3", env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        target, head = r.stdout.strip().splitlines()[-2:]
        assert target.endswith("Qwen3-4B-Q4_K_M.gguf")
        assert Path(head).is_relative_to(tmp_path / "specli" / "heads")
        assert f"specli run -m {target} -md {head} --spec-type draft-eagle3" in r.stderr
        r = specli("download", "--pair", "qwen3-4b-eagle3", "--json", env=env, timeout=120)
        assert json.loads(r.stdout) == {"pair": "qwen3-4b-eagle3", "target": target,
                                        "draft": head, "spec_type": "draft-eagle3"}
        listed = specli("download", "--list-pairs", env=env).stdout
        assert ("qwen3-4b-eagle3: target Qwen/Qwen3-4B-GGUF:Q4_K_M, draft "
                "AngelSlim/Qwen3-4B_eagle3 (draft-eagle3 head)") in listed
    finally:
        h.close()


# --- against llama.cpp's own converter (scripts/record_heads.py) ------------------------------

NATIVE = json.loads((Path(__file__).parent / "data/native_heads.json").read_text())
# where the two may differ, and why: the tokenizer's keys are the target GGUF's as they are
# (specli reads them there); llama.cpp's converter read them from a Hugging Face tokenizer
# rebuilt from the same GGUF, and this converter writes add_eos_token False where the
# tokenizer's post-processor is ByteLevel, which the SmolLM2 file (an older converter's) has
# no key for: false either way (llama.cpp's default for a BPE vocabulary)
ABSENT_IN_TARGET = {"tokenizer.ggml.add_eos_token"}


@pytest.mark.parametrize("layout", sorted(NATIVE["layouts"]))
def test_each_layout_converts_as_llama_cpps_converter_does(tmp_path, made, dflash_made, heads,
                                                           layout):
    """Every tensor's bytes, type and shape, and every key, as convert_hf_to_gguf.py
    --target-model-dir wrote them from the same checkpoint (recorded with torch)."""
    from record_heads import fingerprint

    _, ckpt = (made if layout in EAGLE3_LAYOUTS else dflash_made)(layout)
    out = tmp_path / "head.gguf"
    r = cli("convert-head", str(ckpt), "-m", heads["llama"], "-o", str(out))
    assert r.returncode == 0, r.stderr
    mine, native = fingerprint(out), NATIVE["layouts"][layout]
    assert mine["tensors"] == native["tensors"]
    target = fingerprint(heads["llama"])["keys"]
    assert set(native["keys"]) - set(mine["keys"]) == ABSENT_IN_TARGET - set(target)
    for k, v in mine["keys"].items():
        want = native["keys"].get(k)
        assert want == pytest.approx(v) if isinstance(v, float) else want == v, k


def test_a_bf16_checkpoint_converts_in_a_process_of_its_own(tmp_path, made, heads):
    """bfloat16 is a numpy dtype only once ml_dtypes is imported (this module imports it):
    a `specli convert-head` process of its own must read a bf16 checkpoint too."""
    from conftest import specli

    _, ckpt = made("draftmodel")
    out = tmp_path / "head.gguf"
    r = specli("convert-head", str(ckpt), "-m", heads["llama"], "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert {k for k, _ in _fields(str(out))[1].values()} >= {"BF16"}


@pytest.mark.parametrize("layout", ["specforge", "dflash"])
def test_a_head_dim_of_null_is_as_absent(tmp_path, checkpoint, dflash_made, heads, layout):
    """Some published configs say "head_dim": null: llama.cpp's converter reads it as not
    given (a llama config's width is then hidden_size / heads, written all the same)."""
    from record_heads import fingerprint

    if layout in EAGLE3_LAYOUTS:
        _, ckpt = checkpoint(layout)
    else:
        ckpt = Path(shutil.copytree(dflash_made(layout)[1], tmp_path / "ckpt"))
    cfg = json.loads((ckpt / "config.json").read_text())
    if layout == "dflash":  # qwen3: null is transformers' 128, which these tensors are not
        cfg["head_dim"] = None
        (ckpt / "config.json").write_text(json.dumps(cfg))
        _refused(tmp_path, ckpt, heads["llama"], "expects [512, 64]")
        return
    cfg["head_dim"] = None
    (ckpt / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "head.gguf"
    r = cli("convert-head", str(ckpt), "-m", heads["llama"], "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert fingerprint(out)["tensors"] == NATIVE["layouts"][layout]["tensors"]
    assert fingerprint(out)["keys"]["eagle3.attention.key_length"] == 16
