"""`specli download` and -hf/-hfd against a fake hub on loopback (issue 6): HF_ENDPOINT points
at tests/fakehub.py; no test touches the real hub."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import pytest
from conftest import specli
from fakehub import FakeHub

from specli import hub
from specli.hub import HubError

# 24 MiB: huggingface_hub writes in 10 MiB chunks, so a cut halfway keeps one of them
BIG = b"GGUF" + bytes(range(256)) * (96 * 1024)


def tiny_gguf(path: Path, model: str = "gpt2", n: int = 64) -> bytes:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list([f"t{i}" for i in range(n)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.fixture
def fake(tmp_path):
    h = FakeHub()
    h.add("acme/tiny-GGUF", {
        "tiny-Q4_K_M.gguf": b"GGUF-q4km", "tiny-Q8_0.gguf": b"GGUF-q8", "README.md": b"hi",
        "mmproj-tiny-Q4_K_M.gguf": b"GGUF-mmproj", "big-Q6_K.gguf": BIG,
        "split/tiny-Q2_K-00001-of-00003.gguf": b"GGUF-1",
        "split/tiny-Q2_K-00002-of-00003.gguf": b"GGUF-2",
        "split/tiny-Q2_K-00003-of-00003.gguf": b"GGUF-3",
    })
    yield h
    h.close()


# huggingface_hub's retries without their waits, for the tests that exhaust them
NO_BACKOFF = str(Path(__file__).parent / "nobackoff")


def run(fake: FakeHub, tmp_path: Path, *args: str, offline: bool = False, **env):
    e = {"HF_ENDPOINT": fake.url, "HF_HUB_CACHE": str(tmp_path / "cache"),
         "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": "", "HF_HUB_OFFLINE": "1" if offline else "0",
         "HF_HUB_DISABLE_XET": "1", **env}
    return specli(*args, env=e, timeout=120)


# -- tag resolution, llama.cpp's rules -----------------------------------------------------------

FILES = ["m-Q8_0.gguf", "m-Q4_K_M.gguf", "mmproj-m-Q4_K_M.gguf", "m-IQ4_XS.gguf",
         "s/m-Q2_K-00001-of-00002.gguf", "s/m-Q2_K-00002-of-00002.gguf", "README.md"]


@pytest.mark.parametrize("tag,want", [
    ("Q4_K_M", ["m-Q4_K_M.gguf"]),
    ("q4_k_m", ["m-Q4_K_M.gguf"]),  # case-insensitive
    ("iq4_xs", ["m-IQ4_XS.gguf"]),
    ("Q2_K", ["s/m-Q2_K-00001-of-00002.gguf", "s/m-Q2_K-00002-of-00002.gguf"]),  # whole split
    (None, ["m-Q4_K_M.gguf"]),  # no tag: Q4_K_M first
])
def test_tags_resolve_as_llama_cpp_resolves_them(tag, want):
    assert hub.choose(FILES, tag, "acme/m") == want


def test_no_tag_falls_back_to_q8_0_then_the_first_gguf():
    assert hub.choose(["m-Q5_K.gguf", "m-Q8_0.gguf"], None) == ["m-Q8_0.gguf"]
    assert hub.choose(["m-F16.gguf", "m-BF16.gguf", "mmproj-x.gguf"], None) == ["m-BF16.gguf"]


def test_f16_is_not_bf16():
    assert hub.choose(["m-BF16.gguf", "m-F16.gguf"], "F16") == ["m-F16.gguf"]
    assert hub.choose(["m-BF16.gguf", "m-F16.gguf"], "bf16") == ["m-BF16.gguf"]


def test_a_tag_must_be_followed_by_a_dot_or_a_dash():
    with pytest.raises(HubError, match="no GGUF file in acme/m matches the tag Q4_K"):
        hub.choose(["m-Q4_K_M.gguf", "m-Q4_K_S.gguf"], "Q4_K", "acme/m")


def test_ambiguity_and_no_match_list_the_candidates():
    with pytest.raises(HubError) as e:
        hub.choose(["a/m-Q4_K_M.gguf", "b/m-Q4_K_M.gguf"], "Q4_K_M", "acme/m")
    assert "matches 2 models" in e.value.message and "a/m-Q4_K_M.gguf" in e.value.message
    with pytest.raises(HubError) as e:
        hub.choose(FILES, "Q3_K_L", "acme/m")
    assert "candidates: m-IQ4_XS.gguf, m-Q4_K_M.gguf" in e.value.message
    with pytest.raises(HubError, match="incomplete"):
        hub.choose(["m-Q2_K-00001-of-00003.gguf", "m-Q2_K-00002-of-00003.gguf"], "Q2_K")


# -- the command -----------------------------------------------------------------------------------

def test_download_prints_the_cached_path_last(fake, tmp_path):
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:q4_k_m")
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip().splitlines()[-1])
    assert path.read_bytes() == b"GGUF-q4km"
    assert "models--acme--tiny-GGUF/snapshots/" in str(path)  # the standard HF cache layout
    assert "%|" not in r.stderr and "it/s" not in r.stderr  # no progress bars off a terminal


def test_a_plain_git_file_downloads_too(fake, tmp_path):
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF", "--file", "README.md")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip().splitlines()[-1]).read_bytes() == b"hi"


def test_file_local_dir_and_json(fake, tmp_path):
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF", "--file", "tiny-Q8_0.gguf",
            "--local-dir", str(tmp_path / "models"), "--json")
    assert r.returncode == 0, r.stderr
    import json

    doc = json.loads(r.stdout)
    assert doc["path"] == str(tmp_path / "models" / "tiny-Q8_0.gguf")
    assert Path(doc["path"]).read_bytes() == b"GGUF-q8"


def test_split_models_come_whole(fake, tmp_path):
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q2_K")
    assert r.returncode == 0, r.stderr
    first = Path(r.stdout.strip().splitlines()[-1])
    assert first.name == "tiny-Q2_K-00001-of-00003.gguf"
    assert sorted(p.name for p in first.parent.iterdir()) == [
        f"tiny-Q2_K-0000{i}-of-00003.gguf" for i in (1, 2, 3)]


def test_a_dropped_connection_leaves_a_partial_that_the_next_call_resumes(fake, tmp_path):
    fake.drops["acme/tiny-GGUF/big-Q6_K.gguf"] = 6  # more than huggingface_hub's own retries
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q6_K", PYTHONPATH=NO_BACKOFF)
    assert r.returncode == 2 and r.stdout == ""
    assert "run again to resume" in r.stderr and "Traceback" not in r.stderr
    partial = list((tmp_path / "cache").rglob("*.incomplete"))
    assert len(partial) == 1 and 0 < partial[0].stat().st_size < len(BIG)
    have = partial[0].stat().st_size
    fake.requests.clear()
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q6_K")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip().splitlines()[-1]).read_bytes() == BIG
    gets = [h for m, p, h in fake.requests if m == "GET" and p.endswith("big-Q6_K.gguf")]
    assert (gets[0].get("Range") or gets[0].get("range")) == f"bytes={have}-"


def test_a_partial_from_an_interrupted_run_is_resumed(fake, tmp_path):
    sha = hashlib.sha256(BIG).hexdigest()
    blobs = tmp_path / "cache" / "models--acme--tiny-GGUF" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{sha}.incomplete").write_bytes(BIG[:700_000])  # what an interruption leaves
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q6_K")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip().splitlines()[-1]).read_bytes() == BIG
    gets = [h for m, p, h in fake.requests if m == "GET" and p.endswith("big-Q6_K.gguf")]
    assert (gets[0].get("Range") or gets[0].get("range")) == "bytes=700000-"


def test_local_dir_downloads_resume_too(fake, tmp_path):
    fake.drops["acme/tiny-GGUF/big-Q6_K.gguf"] = 6
    where = tmp_path / "models"
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q6_K", "--local-dir", str(where),
            PYTHONPATH=NO_BACKOFF)
    assert r.returncode == 2
    partial = list(where.rglob("*.incomplete"))
    assert len(partial) == 1 and partial[0].stat().st_size > 0
    have = partial[0].stat().st_size
    fake.requests.clear()
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q6_K", "--local-dir", str(where))
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == where / "big-Q6_K.gguf"
    assert (where / "big-Q6_K.gguf").read_bytes() == BIG
    gets = [h for m, p, h in fake.requests if m == "GET" and p.endswith("big-Q6_K.gguf")]
    assert (gets[0].get("Range") or gets[0].get("range")) == f"bytes={have}-"
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("big*"))


def test_local_dir_replaces_a_file_of_the_wrong_size(fake, tmp_path):
    """A local file whose size differs from the hub's (a copy cut short outside specli) is
    downloaded again, not returned as it is."""
    where = tmp_path / "models"
    where.mkdir()
    (where / "big-Q6_K.gguf").write_bytes(BIG[:1000])
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q6_K", "--local-dir", str(where))
    assert r.returncode == 0, r.stderr
    assert (where / "big-Q6_K.gguf").read_bytes() == BIG
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q6_K", "--local-dir", str(where))
    gets = [h for m, p, h in fake.requests if m == "GET" and p.endswith("big-Q6_K.gguf")]
    assert r.returncode == 0 and len(gets) == 1  # the right size is kept: no second GET


def test_a_sha256_mismatch_deletes_the_file_and_exits_2(fake, tmp_path):
    fake.repos["acme/tiny-GGUF"].tampered["tiny-Q8_0.gguf"] = b"GGUF-evil"
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q8_0")
    assert r.returncode == 2 and r.stdout == ""
    assert "sha256 mismatch" in r.stderr and "deleted" in r.stderr
    assert not any(p.read_bytes() == b"GGUF-evil"
                   for p in (tmp_path / "cache").rglob("*") if p.is_file())


def test_offline_hit_and_miss(fake, tmp_path):
    online = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q4_K_M")
    assert online.returncode == 0
    n = len(fake.requests)
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q4_K_M", offline=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == online.stdout and len(fake.requests) == n  # no request at all
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q8_0", offline=True)
    assert r.returncode == 2
    assert "acme/tiny-GGUF:Q8_0 is not in the local cache and HF_HUB_OFFLINE is set" in r.stderr
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF", "--file", "tiny-Q8_0.gguf",
            offline=True)
    assert r.returncode == 2 and "acme/tiny-GGUF/tiny-Q8_0.gguf is not in the local cache" \
        in r.stderr
    r = run(fake, tmp_path, "download", "acme/other-GGUF", offline=True)
    assert r.returncode == 2 and "acme/other-GGUF is not in the local cache" in r.stderr


def test_hub_errors_are_one_clear_line(fake, tmp_path):
    fake.add("acme/private-GGUF", {"p-Q4_K_M.gguf": b"GGUF-p"}, private=True)
    r = run(fake, tmp_path, "download", "acme/private-GGUF")
    assert r.returncode == 2 and "repository not found (or private): acme/private-GGUF" \
        in r.stderr
    r = run(fake, tmp_path, "download", "acme/private-GGUF", "--hf-token", fake.token)
    assert r.returncode == 0, r.stderr
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF", "--file", "nope.gguf")
    assert r.returncode == 2 and "file not found: acme/tiny-GGUF/nope.gguf" in r.stderr
    r = run(fake, tmp_path, "download", "not a repo")
    assert r.returncode == 2 and "not a Hugging Face repository" in r.stderr
    r = run(fake, tmp_path, "download", "--pair", "qwen3-8b", "--revision", "v1")
    assert r.returncode == 2 and "do not go with --pair" in r.stderr


# -- pair presets --------------------------------------------------------------------------------

def test_list_pairs_shows_the_seed_presets(fake, tmp_path):
    r = run(fake, tmp_path, "download", "--list-pairs")
    assert r.returncode == 0
    for name in ("llama3.3-70b", "llama3.1-8b", "qwen3-8b", "gemma3-27b"):
        assert name in r.stdout
    # not a terminal: one whole record per line, repository ids never cut
    for p in hub.pairs():
        assert f"{p.name}: target {p.target}, draft {p.draft}" in r.stdout


def test_a_pair_preset_downloads_both_and_checks_them(fake, tmp_path):
    ok = tiny_gguf(tmp_path / "ok.gguf")
    other = tiny_gguf(tmp_path / "other.gguf", model="llama")
    p = hub.pair("llama3.1-8b")
    fake.add(p.target.repo, {"Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf": ok})
    fake.add(p.draft.repo, {"Llama-3.2-1B-Instruct-Q4_K_M.gguf": ok})
    r = run(fake, tmp_path, "download", "--pair", "llama3.1-8b")
    assert r.returncode == 0, r.stderr
    target, draft = r.stdout.strip().splitlines()[-2:]
    assert Path(target).name == "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf"
    assert Path(draft).name == "Llama-3.2-1B-Instruct-Q4_K_M.gguf"
    assert "check-pair: compatible" in r.stderr
    g = hub.pair("gemma3-27b")
    fake.add(g.target.repo, {"google_gemma-3-27b-it-Q4_K_M.gguf": ok})
    fake.add(g.draft.repo, {"google_gemma-3-1b-it-Q4_K_M.gguf": other})
    r = run(fake, tmp_path, "download", "--pair", "gemma3-27b")
    assert r.returncode == 1 and "incompatible (vocab-type)" in r.stderr


# -- run -hf / -hfd -------------------------------------------------------------------------------

def test_run_resolves_hf_and_hfd_through_the_same_code(fake, tmp_path, q4_1):
    data = Path(q4_1).read_bytes()
    fake.add("acme/smol-GGUF", {"SmolLM2-135M-Instruct-Q4_1.gguf": data})
    r = run(fake, tmp_path, "run", "-hf", "acme/smol-GGUF:Q4_1", "-hfd", "acme/smol-GGUF:q4_1",
            "-p", "Hello", "-n", "4", "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr
    import json

    doc = json.loads(r.stdout)
    assert doc["model"].endswith("SmolLM2-135M-Instruct-Q4_1.gguf")
    assert doc["model_draft"] == doc["model"] and doc["stats"]["n_predict"] == 4
    r = run(fake, tmp_path, "run", "-m", q4_1, "-hf", "acme/smol-GGUF", "-p", "x")
    assert r.returncode == 2 and "give -m or -hf, not both" in r.stderr


def test_progress_bars_show_on_a_terminal(fake, tmp_path):
    """On a terminal (a pseudo-terminal through util-linux `script`) huggingface_hub's bars
    are shown; off one, none (test_download_prints_the_cached_path_last)."""
    import os
    import shlex
    import shutil
    import subprocess
    import sys

    if shutil.which("script") is None:
        pytest.skip("util-linux script is not installed")
    env = {**os.environ, "HF_ENDPOINT": fake.url, "HF_HUB_CACHE": str(tmp_path / "cache"),
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": "", "HF_HUB_OFFLINE": "0",
           "TERM": "xterm", "COLUMNS": "100"}
    cmd = shlex.join([sys.executable, "-m", "specli", "download", "acme/tiny-GGUF:Q6_K"])
    # a pty from `script` has no size until told: tqdm would draw a bar 0 columns wide
    r = subprocess.run(["script", "-qec", f"stty cols 100 rows 40; {cmd}", "/dev/null"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "big-Q6_K.gguf" in r.stdout and "100%" in r.stdout  # the bar, completed
