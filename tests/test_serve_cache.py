"""The prompt cache (issue 18, part 5): a slot reuses the longest common prefix of its cache,
says how much (`timings.cache_n`, `tokens_cached`, `prompt_tokens_details.cached_tokens`),
and `cache_prompt: false` starts from an empty cache. Real SmolLM2, one slot, in-process."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from specli.config import ModelParams, SamplingParams
from specli.plan import SpecPlan
from specli.server.app import ServerConfig, State, create_app

PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def client(q4_1):
    cfg = ServerConfig(target=ModelParams(path=q4_1, n_ctx=256),
                       sampling=SamplingParams(temp=0.0), n_predict=4,
                       plan=SpecPlan.resolve(("ngram-simple",)))
    st = State(cfg)
    st.load()
    with TestClient(create_app(st.config, state=st)) as c:  # one client: one event loop
        yield c


def completion(client, **body) -> dict:
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 4, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_repeated_prompt_is_taken_from_the_cache(client):
    first = completion(client, cache_prompt=False)
    n = first["tokens_evaluated"]
    assert first["timings"]["cache_n"] == 0 and first["timings"]["prompt_n"] == n
    assert first["tokens_cached"] == n + first["tokens_predicted"] - 1
    again = completion(client)
    # all but the last prompt token, which opens the first verification batch
    assert again["timings"]["cache_n"] == n - 1 and again["timings"]["prompt_n"] == 1
    assert again["content"] == first["content"]


def test_cache_prompt_false_evaluates_the_whole_prompt(client):
    completion(client)
    cold = completion(client, cache_prompt=False)
    assert cold["timings"]["cache_n"] == 0
    assert cold["timings"]["prompt_n"] == cold["tokens_evaluated"]


def test_a_longer_prompt_reuses_the_common_prefix(client):
    base = completion(client, cache_prompt=False)
    r = client.post("/completion", json={"prompt": PROMPT + " red, yellow and", "n_predict": 2})
    longer = r.json()
    assert 0 < longer["timings"]["cache_n"] < longer["tokens_evaluated"]
    assert longer["timings"]["cache_n"] >= base["tokens_evaluated"] - 1


def test_chat_usage_reports_cached_tokens(client):
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3}
    first = client.post("/v1/chat/completions", json=body).json()
    second = client.post("/v1/chat/completions", json=body).json()
    assert "prompt_tokens_details" in first["usage"]
    details = second["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == second["usage"]["prompt_tokens"] - 1
