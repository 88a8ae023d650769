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
