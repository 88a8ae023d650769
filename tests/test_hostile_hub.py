"""The Hub unreachable or the cache broken (issue 16, items 11-12): one line, exit 2, within
seconds; never the library's half a minute of retries or a traceback. The "no network" case
runs inside `unshare --net`, a namespace with no way out."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_audit import needs_netns
from test_download import fake, run  # noqa: F401 - the fake hub fixture

from specli import hub

ENV = {"HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": "", "HF_HUB_DISABLE_XET": "1"}


def one_line(r, needle: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@needs_netns
@pytest.mark.parametrize("endpoint", [None, "https://huggingface.co"])
def test_no_network_is_one_line_within_seconds(tmp_path, endpoint):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HTTP", "http",
                                                                     "ALL_", "all_"))}
    env.update(ENV, HF_HUB_CACHE=str(tmp_path / "cache"))
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    t0 = time.monotonic()
    r = subprocess.run(["unshare", "--net", sys.executable, "-m", "specli", "download",
                        "acme/tiny-GGUF:Q4_K_M", "-q"], capture_output=True, text=True,
                       env=env, timeout=60)
    one_line(r, "cannot reach the Hub")
    assert "HF_HUB_OFFLINE=1" in r.stderr and "cached files of acme/tiny-GGUF: none" in r.stderr
    assert time.monotonic() - t0 < 15


def test_an_unreachable_port_is_named(monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    assert "cannot connect to 127.0.0.1" in hub._unreachable()


def test_a_cache_that_is_a_file_is_one_line(fake, tmp_path):  # noqa: F811
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q4_K_M", offline=True,
            HF_HUB_CACHE="/etc/hostname")
    one_line(r, "cannot read /etc/hostname")


def test_a_refs_file_that_is_not_text_is_one_line(fake, tmp_path):  # noqa: F811
    assert run(fake, tmp_path, "download", "acme/tiny-GGUF:Q4_K_M").returncode == 0
    refs = next((tmp_path / "cache").glob("models--acme--tiny-GGUF/refs/main"))
    refs.write_bytes(b"\xff\xfe\x00garbage")
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q4_K_M", offline=True)
    one_line(r, "cannot read")


def test_an_ambiguous_tag_offline_says_ambiguous(fake, tmp_path):  # noqa: F811
    fake.add("acme/two-GGUF", {"a-Q4_K_M.gguf": b"GGUF-a", "b-Q4_K_M.gguf": b"GGUF-b"})
    for name in ("a-Q4_K_M.gguf", "b-Q4_K_M.gguf"):
        assert run(fake, tmp_path, "download", "acme/two-GGUF", "--file", name).returncode == 0
    r = run(fake, tmp_path, "download", "acme/two-GGUF:Q4_K_M", offline=True)
    one_line(r, "is ambiguous: it matches 2 models")
    assert "not in the local cache" not in r.stderr
    assert "a-Q4_K_M.gguf" in r.stderr and "b-Q4_K_M.gguf" in r.stderr
    assert Path(tmp_path / "cache").is_dir()


# -- a hostile mirror names the files (issue 31, item 2) --------------------------------------

@pytest.mark.parametrize("name", ["../../../../../x.gguf", "ABS/x_abs.gguf",
                                  "sub/../../../../x.gguf", "sub/./x.gguf", "a\\..\\x.gguf",
                                  "x\x1b]0;pwned\x07-Q4_K_M.gguf"])
def test_a_mirror_cannot_name_a_file_outside_local_dir(fake, tmp_path, name):  # noqa: F811
    """The mirror supplies the name, the bytes and their sha256: only the name can be
    checked, and a name that leaves --local-dir is refused before anything is written."""
    name = name.replace("ABS", str(tmp_path))
    where = tmp_path / "a" / "b" / "c" / "d" / "models"
    where.mkdir(parents=True)
    victims = [tmp_path / "x.gguf", tmp_path / "a" / "x.gguf", tmp_path / "x_abs.gguf"]
    existing = tmp_path / "a" / "x.gguf"
    existing.write_bytes(b"precious")
    fake.add("evil/mirror-GGUF", {name: b"GGUF-evil", "README.md": b"hi"})
    r = run(fake, tmp_path, "download", "evil/mirror-GGUF", "--local-dir", str(where))
    one_line(r, "unsafe file name")
    assert existing.read_bytes() == b"precious"
    assert not any(v.exists() for v in victims if v != existing)
    assert [p for p in tmp_path.rglob("*") if p.is_file() and "cache" not in p.parts] == \
        [existing]
    # by its file name too, and without --local-dir
    r = run(fake, tmp_path, "download", "evil/mirror-GGUF", "--file", name)
    one_line(r, "unsafe file name")


@pytest.mark.parametrize("header,what", [("tag", "ETag"), ("x-repo-commit", "commit")])
def test_a_mirror_cannot_name_the_blob_or_snapshot(fake, tmp_path, monkeypatch,  # noqa: F811
                                                   header, what):
    """The cache names a blob by the ETag the mirror sends, a snapshot by its commit."""
    import fakehub

    real = fakehub.FakeHub._resolve

    def hostile(self, h, name, file, body):
        send = h.send_header
        h.send_header = lambda k, v: send(k, '"../../../../evil-x"' if header in k.lower()
                                          else v)
        return real(self, h, name, file, body)

    monkeypatch.setattr(fakehub.FakeHub, "_resolve", hostile)
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q4_K_M")
    assert r.returncode == 2, r.stderr
    assert f"{what} that is no hash" in r.stderr.splitlines()[-1], r.stderr
    assert not list(tmp_path.rglob("evil-x*"))


def test_a_mirror_is_asked_once_per_file(fake, tmp_path, monkeypatch):  # noqa: F811
    """huggingface_hub would ask again before linking the snapshot, and trust a second
    answer (another ETag, another commit) without a check: specli links it itself."""
    import fakehub

    real, answers = fakehub.FakeHub._resolve, []

    def changing(self, h, name, file, body):
        if not body:
            answers.append(file)
        send = h.send_header
        if len(answers) > 1:  # every answer after the first: a path for a name
            h.send_header = lambda k, v: send(k, '"../../../../evil-x"' if "tag" in k.lower()
                                              else v)
        return real(self, h, name, file, body)

    monkeypatch.setattr(fakehub.FakeHub, "_resolve", changing)
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q4_K_M")
    assert r.returncode == 0, r.stderr
    assert answers == ["tiny-Q4_K_M.gguf"]
    path = Path(r.stdout.strip().splitlines()[-1])
    assert path.read_bytes() == b"GGUF-q4km" and "snapshots" in path.parts
    assert not list(tmp_path.rglob("evil-x*"))
    r = run(fake, tmp_path, "download", "acme/tiny-GGUF:Q4_K_M", offline=True)
    assert r.returncode == 0 and Path(r.stdout.strip().splitlines()[-1]) == path, r.stderr
