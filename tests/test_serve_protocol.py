"""llama-server's protocol details (issue 22): CORS, /completions as llama-server's own,
llama-server's fields on /v1/completions, ignore_eos, response_fields, system_fingerprint,
/metrics when off. CORS needs no model: the app answers a preflight before anything else."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from test_serve_features import PROMPT, server  # noqa: F401 - the module's server fixture

from specli.config import ModelParams
from specli.server.app import ServerConfig, State, create_app

PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "Authorization"}


def cors_client(**kw) -> TestClient:
    cfg = ServerConfig(target=ModelParams(path="unused.gguf"), api_keys=("k",), **kw)
    return TestClient(create_app(cfg, state=State(cfg)))  # never loaded: no model needed


@pytest.mark.parametrize("origin", ["localhost", "http://web.mydomain.fr"])
def test_a_preflight_is_answered_before_the_key_with_llama_servers_defaults(origin):
    r = cors_client().options("/completions", headers={"Origin": origin, **PREFLIGHT})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == origin
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert r.headers["access-control-allow-headers"] == "*"
    r = cors_client().get("/health", headers={"Origin": origin})
    assert r.headers["access-control-allow-origin"] == origin  # on every answer


@pytest.mark.parametrize("origin,allowed", [
    ("http://localhost:8080", True), ("http://127.0.0.1", True), ("http://[::1]:3000", True),
    ("http://evil.com", False), ("http://localhost.evil.com", False),
    ("http://notlocalhost", False)])
def test_cors_origins_localhost_echoes_only_this_machine(origin, allowed):
    r = cors_client(cors_origins="localhost").options(
        "/v1/chat/completions", headers={"Origin": origin, **PREFLIGHT})
    assert r.status_code == 200
    assert r.headers.get("access-control-allow-origin") == (origin if allowed else None)


def test_a_list_of_origins_echoes_those_it_holds():
    c = cors_client(cors_origins="https://a.example, https://b.example")
    ok = c.options("/completion", headers={"Origin": "https://b.example", **PREFLIGHT})
    no = c.options("/completion", headers={"Origin": "https://c.example", **PREFLIGHT})
    assert ok.headers["access-control-allow-origin"] == "https://b.example"
    assert "access-control-allow-origin" not in no.headers


def test_completions_without_v1_is_llama_servers_own(server):  # noqa: F811
    with server.http() as h:
        r = h.post("/completions", json={"prompt": PROMPT, "n_predict": 4}).json()
        assert "content" in r and r["tokens_predicted"] <= 4
        v1 = h.post("/v1/completions", json={"prompt": PROMPT, "n_predict": 4,
                                              "return_tokens": True,
                                              "cache_prompt": False}).json()
        choice = v1["choices"][0]
        assert choice["text"] == r["content"] and len(choice["tokens"]) == 4
        assert v1["system_fingerprint"].endswith("-specli")


def test_ignore_eos_and_response_fields(server):  # noqa: F811
    with server.http() as h:
        short = h.post("/completion", json={"prompt": "Say hi.", "n_predict": 200}).json()
        assert short["stop_type"] == "eos"
        n = short["tokens_predicted"] + 8
        long = h.post("/completion", json={"prompt": "Say hi.", "n_predict": n,
                                           "ignore_eos": True}).json()
        assert long["tokens_predicted"] == n and long["stop_type"] == "limit"
        picked = h.post("/completion", json={
            "prompt": PROMPT, "n_predict": 3,
            "response_fields": ["content", "generation_settings/n_predict", "prompt",
                                "no/such"]}).json()
        assert set(picked) == {"content", "generation_settings/n_predict", "prompt"}
        assert picked["generation_settings/n_predict"] == 3
        assert picked["prompt"].endswith(PROMPT)


def test_metrics_when_off_is_501(server):  # noqa: F811
    with server.http() as h:
        r = h.get("/metrics")
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_stream_chunks_carry_their_tokens_and_verbose_shows_the_prompt(server):  # noqa: F811
    import json

    with server.http() as h:
        whole = h.post("/completion", json={"prompt": PROMPT, "n_predict": 8,
                                            "return_tokens": True}).json()
        with h.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": 8,
                                                   "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        assert [t for c in chunks for t in c["tokens"]] == whole["tokens"]
        v = h.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
            "verbose": True}).json()
        assert PROMPT in v["__verbose"]["prompt"]
