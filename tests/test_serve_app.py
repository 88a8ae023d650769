"""The server app in-process: /health while loading, and schemathesis fuzzing of every route
against the app's own OpenAPI schema (issue 5): no input may cause a 5xx."""

from __future__ import annotations

import threading

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from specli.config import ModelParams, SamplingParams
from specli.server.app import ServerConfig, State, create_app


def _config(path: str, **kw) -> ServerConfig:
    return ServerConfig(target=ModelParams(path=path, n_ctx=64),
                        sampling=SamplingParams(temp=0.0), n_predict=8, **kw)


def test_health_is_503_while_loading_then_200(q4_1):
    release = threading.Event()
    st = State(_config(q4_1))
    real_load = st.load

    def slow_load() -> None:
        release.wait(30)
        real_load()

    st.load = slow_load
    with TestClient(create_app(st.config, state=st)) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503
        release.set()
        for _ in range(100):
            if client.get("/health").status_code == 200:
                break
            threading.Event().wait(0.1)
        assert client.get("/health").json()["slots_idle"] == 1


def test_a_model_that_cannot_load_keeps_health_at_503_with_the_reason(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 40)
    seen: list[BaseException] = []
    with TestClient(create_app(_config(str(bad)), on_fatal=seen.append)) as client:
        for _ in range(100):
            if seen:
                break
            threading.Event().wait(0.05)
        r = client.get("/health")
    assert seen and r.status_code == 503
    assert "not a valid GGUF file" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def loaded_app(q4_1):
    st = State(_config(q4_1))
    st.load()
    yield create_app(st.config, state=st)
    st.pool.close()


@pytest.fixture(scope="module")
def operations(loaded_app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", loaded_app)
    return [result.ok() for result in schema.get_all_operations()]


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_requests_never_get_a_5xx(operations, data):
    """Cases drawn from the app's own OpenAPI schema, across every route, schema-valid and
    schema-violating (pytest's own schemathesis plugin does not run on this pytest, so the
    strategies are drawn directly)."""
    op = data.draw(st.sampled_from(operations))
    mode = data.draw(st.sampled_from(list(GenerationMode)))  # valid and invalid input
    case = data.draw(op.as_strategy(generation_mode=mode))
    response = case.call()
    assert response.status_code < 500 or _not_served(case.path, response.status_code), (
        case.method, case.path, case.body, response.text)


# every route that reads a body, from the app's own schema (no model is loaded to list them)
BODY_ROUTES = sorted(
    path for path, ops in create_app(_config("unused.gguf")).openapi()["paths"].items()
    if "post" in ops and "requestBody" in ops["post"])


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_every_route_answers_malformed_shapes_with_a_4xx(operations, path):
    """Each route on its own, with shapes drawn from its schema, most of them wrong (a
    string where an object goes, a number for a list, a missing field, deep in the body):
    a 400 that names the field, never a 5xx (issue 55: a tool_choice whose function was a
    string, a history call that was `[{}]`, Messages' tools of 5, a Responses output of
    5 each answered 500)."""
    op = next(o for o in operations if o.path == path and o.method.upper() == "POST")

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def sweep(data):
        mode = data.draw(st.sampled_from([GenerationMode.NEGATIVE] * 3
                                         + [GenerationMode.POSITIVE]))
        case = data.draw(op.as_strategy(generation_mode=mode))
        r = case.call()
        assert r.status_code < 500, (path, case.body, r.text)
        if r.status_code == 400 and mode is GenerationMode.NEGATIVE and \
                isinstance(case.body, dict) and case.body:
            err = r.json()["error"]
            assert err["message"] and "Traceback" not in err["message"], r.text

    sweep()


@pytest.fixture(scope="module")
def hostile_app(q4_1):
    """Its own slots, and one client (one event loop) for every example."""
    st = State(_config(q4_1))
    st.load()
    with TestClient(create_app(st.config, state=st)) as client:
        yield client


# strings and arrays a hostile client sends (issue 16): lone surrogates, NUL, huge values
HOSTILE = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800", "\x00", "\x00" * 4096,
                           "x" * 200_000, "\u202e\u0000{{ 7 * 7 }}", "\ufffe"])
HUGE = st.sampled_from([list(range(100_000)), ["x"] * 100_000, [{}] * 10_000])


def _mutate(value, draw, depth: int = 0):
    """value with one leaf (a string, an array or anything at random) made hostile."""
    if isinstance(value, dict) and value and depth < 6:
        key = draw(st.sampled_from(sorted(value)))
        return {**value, key: _mutate(value[key], draw, depth + 1)}
    if isinstance(value, list) and value and depth < 6 and draw(st.booleans()):
        i = draw(st.integers(0, len(value) - 1))
        return value[:i] + [_mutate(value[i], draw, depth + 1)] + value[i + 1:]
    return draw(st.one_of(HOSTILE, HUGE))


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hostile_strings_and_arrays_never_get_a_5xx(hostile_app, operations, data):
    """Schema-valid cases from the app's schema, one value swapped for a lone surrogate, NUL,
    a 200 kB string or a 100,000-item array: sent as JSON escapes, as a client would."""
    import json

    op = data.draw(st.sampled_from([o for o in operations if o.method.upper() == "POST"]))
    case = data.draw(op.as_strategy(generation_mode=GenerationMode.POSITIVE))
    body = _mutate(case.body if isinstance(case.body, dict) else {}, data.draw)
    r = hostile_app.post(case.formatted_path, content=json.dumps(body),
                    headers={"Content-Type": "application/json"})
    assert r.status_code < 500 or _not_served(case.path, r.status_code), (
        case.path, body if len(str(body)) < 2000 else "...", r.text)


def _not_served(path: str, status: int) -> bool:
    """llama-server's 501 for an endpoint turned off (/metrics without --metrics)."""
    return status == 501 and path in ("/metrics", "/slots")
