"""docs/scale-out.md's HAProxy block, run as written (addresses aside) in front of two real
`specli serve` replicas: least connections spreads concurrent requests, /health checks and a
redispatch route around a replica that died (issue 21)."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_rpc import free_port
from test_serve import Server

ROOT = Path(__file__).parents[1]
HAPROXY = shutil.which("haproxy")
pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (.ci/run "
                                "installs it)")


def documented_config() -> str:
    text = (ROOT / "docs" / "scale-out.md").read_text()
    return re.search(r"```haproxy\n(.*?)```", text, re.S).group(1)


def test_the_documented_haproxy_config_balances_and_routes_around_a_dead_replica(
        tmp_path, f16):
    replicas = [Server("-m", f16, "-c", "1024", "-t", "1", "--temp", "0") for _ in range(2)]
    port = free_port()
    cfg = documented_config()
    for old, new in (("bind :8080", f"bind 127.0.0.1:{port}"),
                     ("10.0.0.21:8080", f"127.0.0.1:{replicas[0].port}"),
                     ("10.0.0.22:8080", f"127.0.0.1:{replicas[1].port}")):
        assert old in cfg
        cfg = cfg.replace(old, new)
    (tmp_path / "haproxy.cfg").write_text(cfg)
    check = subprocess.run([HAPROXY, "-c", "-f", str(tmp_path / "haproxy.cfg")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    lb = subprocess.Popen([HAPROXY, "-db", "-f", str(tmp_path / "haproxy.cfg")],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", verify=False, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "haproxy did not come up"
            time.sleep(0.2)
        # two long requests at once: least connections gives each replica one
        done: list[int] = []

        def long_request() -> None:
            try:
                r = httpx.post(f"{url}/v1/completions", verify=False, timeout=120, json={
                    "prompt": "Tell me a story", "max_tokens": 100, "ignore_eos": True})
                done.append(r.status_code)
            except httpx.TransportError:
                done.append(0)

        threads = [threading.Thread(target=long_request) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while [httpx.get(f"{r.url}/health", verify=False).json()["slots_processing"]
               for r in replicas] != [1, 1]:
            assert time.monotonic() < deadline, "the requests did not spread over both"
            time.sleep(0.1)
        # one replica dies mid-request; every request after it is answered by the other
        replicas[0].proc.kill()
        replicas[0].proc.wait(10)
        for _ in range(3):
            r = httpx.post(f"{url}/v1/completions", verify=False, timeout=120,
                           json={"prompt": "The capital of France is", "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"]
        for t in threads:
            t.join(120)
        assert 200 in done  # the survivor's long request completed
    finally:
        lb.terminate()
        lb.wait(10)
        for r in replicas:
            r.stop()
