"""Hostile clients against `specli serve` (issue 16, items 1-6, and the server side of 2 and
10): nothing a request sends blocks the event loop, crashes a route or is coerced; SIGTERM
always ends the server."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from fakeserver import serve
from hostile_models import with_nan, with_template
from test_hostile_files import DOUBLE, LOOP
from test_serve import InProcess, Server

KEY = "test-key-123"


@pytest.fixture(scope="module")
def server(q4_1):
    s = InProcess("-m", q4_1, "-c", "1024", "--api-key", KEY, "--temp", "0")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fake():
    """The app in process on fake engines: for what is answered before any model runs
    (parsing, types, the plan), where the model's text does not matter."""
    with serve(key=KEY) as client:
        yield client


def health_while(s: Server, send) -> tuple[httpx.Response, float]:
    """send() in a thread; meanwhile /health is polled. Returns send's response and the
    slowest /health answer seen."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(send()))
    t.start()
    slowest = 0.0
    with httpx.Client(verify=False, base_url=s.url, timeout=5) as h:
        while t.is_alive():
            t0 = time.monotonic()
            assert h.get("/health").status_code == 200
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.05)
    t.join()
    return out[0], slowest


def post(s, path: str, body, timeout: float = 60, **kw) -> httpx.Response:
    """POST to a real server (Server) or the app in process (fake)."""
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    if not isinstance(s, Server):  # in process: no timeout to set
        return s.post(path, content=content, **kw)
    with s.http() as h:
        return h.post(path, content=content, timeout=timeout, **kw)


# -- 1. no request blocks the event loop ------------------------------------------------------

@pytest.mark.parametrize("name,path,body", [
    ("200,000 messages", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}] * 200_000, "max_tokens": 4}),
    ("a 7.5 MB prompt", "/completion", {"prompt": "word " * 1_500_000, "n_predict": 4}),
    ("a 7.5 MB message", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "word " * 1_500_000}], "max_tokens": 4}),
])
def test_a_huge_request_is_refused_and_health_keeps_answering(server, name, path, body):
    t0 = time.monotonic()
    r, slowest = health_while(server, lambda: post(server, path, body))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] in ("context_length_exceeded", "too_long")
    assert slowest < 1.0 and time.monotonic() - t0 < 15, (slowest, name)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_server_with_a_generation_in_flight(q4_1, sig):
    s = Server("-m", q4_1, "-c", "1024")
    try:
        with httpx.Client(verify=False, base_url=s.url, timeout=60) as h, h.stream(
                "POST", "/completion", json={"prompt": "Count to a thousand:",
                                             "n_predict": 900, "stream": True}) as r:
            next(r.iter_lines())  # generating now
            assert s.ends_on(sig) < 5
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


# -- 2. hostile templates: 400 naming the template, the loop free meanwhile --------------------

@pytest.mark.parametrize("template,needle", [(LOOP, "ran for more than"),
                                             (DOUBLE, "built a value of")])
def test_a_hostile_template_is_a_400_and_health_keeps_answering(tmp_path, q4_1, template,
                                                                needle, monkeypatch):
    from specli import chat

    if needle == "ran for more than":  # the loop stopped sooner than in 5 s (the other
        monkeypatch.setattr(chat, "RENDER_SECONDS", 1.5)  # stops on its size, in time)
    s = InProcess("-m", with_template(q4_1, tmp_path / "t.gguf", template), "-c", "256")
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r, slowest = health_while(s, lambda: post(s, "/v1/chat/completions", body))
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        assert needle in r.json()["error"]["message"] and slowest < 1.0
        r = post(s, "/completion", {"prompt": "hi", "n_predict": 2})  # still serving
        assert r.status_code == 200, r.text
    finally:
        s.stop()


# a template that renders a plain conversation (it passes serve's check at start) and, for
# the message "boom", sorts sixteen million strings in one filter call (78 s and 3.2 GB)
BOOM = ('{% if messages[-1].content == "boom" %}{{ ("ab" * 8000000) | list | sort | length }}'
        '{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}'
        '<|im_end|>\n{% endfor %}<|im_start|>assistant\n')


def test_templates_past_their_budget_leave_the_server_serving(tmp_path, q4_1):
    """Six requests whose render runs past its budget inside one filter call, through the
    GGUF's own template: each a 400 (stopped) or a 503 (every renderer busy) within
    seconds; meanwhile /health answers in under a second and other routes at once, the
    server does not grow, and afterwards the slot serves a plain chat."""
    s = Server("-m", with_template(q4_1, tmp_path / "boom.gguf", BOOM), "-c", "512")
    try:
        rss, answers = s.rss_kb(), []
        boom = {"messages": [{"role": "user", "content": "boom"}], "max_tokens": 2}

        def six() -> list[httpx.Response]:
            threads = [threading.Thread(target=lambda: answers.append(
                post(s, "/v1/chat/completions", boom))) for _ in range(6)]
            for t in threads:
                t.start()
            time.sleep(0.5)  # the renders are under way: other routes still answer now
            t0 = time.monotonic()
            others = [post(s, "/tokenize", {"content": "hi"}, timeout=10),
                      post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                           timeout=10)]
            assert all(r.status_code == 200 for r in others), [r.text for r in others]
            assert time.monotonic() - t0 < 3
            for t in threads:
                t.join(60)
            return answers

        t0 = time.monotonic()
        got, slowest = health_while(s, six)
        assert slowest < 1.0 and time.monotonic() - t0 < 40
        assert sorted({r.status_code for r in got}) in ([400], [400, 503]), \
            [r.text for r in got]
        assert all("chat template was stopped" in r.json()["error"]["message"]
                   for r in got if r.status_code == 400)
        assert s.rss_kb() - rss < 200_000, (rss, s.rss_kb())
        r = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        s.stop()


def test_sigterm_ends_the_server_during_a_render_past_its_budget(tmp_path, q4_1):
    """A template from --chat-template-file, rendering past its budget when the server is
    told to stop: it stops within seconds (it waited minutes: "timeout graceful shutdown
    exceeded")."""
    (tmp_path / "boom.jinja").write_text(BOOM)
    s = Server("-m", q4_1, "-c", "512", "--chat-template-file", str(tmp_path / "boom.jinja"))
    try:
        t = threading.Thread(target=lambda: post(s, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "boom"}], "max_tokens": 2}), daemon=True)
        t.start()
        time.sleep(1.0)  # inside the sort
        assert s.ends_on(signal.SIGTERM) < 10
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


# -- 3, 4. surrogates and types: 400 in the API's own terms -------------------------------------

SURROGATE = '"\\ud800"'
SURROGATE_CASES = [
    ("/completion", '{"prompt": %s}'),
    ("/v1/completions", '{"prompt": %s}'),
    ("/v1/completions", '{"prompt": [%s]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}]}'),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x", "name": %s}]}'),
    ("/v1/chat/completions", '{"model": %s, "messages": [{"role": "user", "content": "x"}]}'),
    ("/v1/completions", '{"model": %s, "prompt": "x"}'),
    ("/completion", '{"prompt": "x", "stop": [%s]}'),
]


@pytest.mark.parametrize("path,template", SURROGATE_CASES)
def test_a_lone_surrogate_is_a_400(fake, path, template):
    r = post(fake, path, template % SURROGATE)
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,message", [
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, "max_tokens must be an integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens must be an integer"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream must be a boolean"),
    ("/completion", {"prompt": "x", "speculative": "yes"},
     "speculative must be an object or a boolean"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content must be a string or an array"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                         "text": 1}]}]},
     "messages[0].content[0].text must be a string"),
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature must be a number"),
])
def test_types_are_strict_and_errors_speak_the_api(fake, path, body, message):
    r = post(fake, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == message, err
    assert ".str" not in err["message"] and "Speculative." not in err["message"]


def test_an_unknown_key_is_named_as_the_client_wrote_it(fake):
    for body, key in (({"prompt": "x", "Foo": 1}, "Foo"), ({"prompt": "x", "max-tokens": 1},
                                                             "max-tokens"),
                      ({"prompt": "x", "speculative": {"N_max": 1}}, "speculative.N_max")):
        r = post(fake, "/completion", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == key, r.text


def test_a_type_the_loaded_models_cannot_serve_is_a_400(fake):
    """A request's own speculative.type goes through the server's plan (SpecPlan.request):
    draft-simple without a draft model names the parameter and the flag; n-gram types
    alone are served."""
    body = {"prompt": "x", "n_predict": 2, "speculative": {"type": "ngram-simple,draft-simple"}}
    r = post(fake, "/completion", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "speculative.type" and "needs a draft model" in err["message"] \
        and "-md" in err["message"], err
    r = post(fake, "/completion", {**body, "speculative": {"type": "ngram-simple"}})
    assert r.status_code == 200, r.text


def test_a_body_that_is_not_utf8_is_a_400(fake):
    r = post(fake, "/completion", b'{"prompt": "\xed\xa0\x80"}')
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body", [b"", b"null", b"[]", b"7"])
def test_a_body_that_is_not_an_object_says_so(fake, body):
    r = post(fake, "/v1/chat/completions", body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] in ("the request body must be a JSON object",
                                            "the body is not valid JSON"), r.text


# -- issue 55: the agents' shapes, checked as the request is read ------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CALLER = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
WEATHER = [{"type": "function", "function": {"name": "get_weather",
                                             "parameters": {"type": "object"}}}]
DEEP = "[" * 100_000 + "]" * 100_000  # past json's depth on any Python


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "tools": WEATHER, "tool_choice": {
        "type": "function", "function": "get_weather"}}, "tool_choice.function"),
    ("/v1/chat/completions", {**CHAT, "messages": [*CALLER[:1], {**CALLER[1], "tool_calls":
                                                                 "get_weather()"}]},
     "messages[1].tool_calls"),
    ("/v1/chat/completions", {**CHAT, "messages": [*CALLER[:1], {**CALLER[1],
                                                                 "tool_calls": [{}]}]},
     "messages[1].tool_calls[0].function"),
    ("/v1/chat/completions", {**CHAT, "messages": [*CALLER[:1], {**CALLER[1], "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": DEEP}}]},
        {"role": "user", "content": "and?"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": 5}}]}, "tools[0].function.parameters"),
    ("/v1/messages", {**CHAT, "tools": 5}, "tools"),
    ("/v1/messages", {**CHAT, "tools": [{"name": 5}]}, "tools[0].name"),
    ("/v1/messages", {**CHAT, "tool_choice": "any"}, "tool_choice"),
    ("/v1/messages", {**CHAT, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ("/v1/messages", {**CHAT, "system": [{"type": "text"}]}, "system[0].text"),
    ("/v1/messages", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}]},
     "messages[0].content[0].input"),
    ("/v1/messages", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": 5}]}]},
     "messages[0].content[0].content"),
    ("/v1/messages/count_tokens", {**CHAT, "tools": 5}, "tools"),
    ("/v1/responses", {"input": "hi", "text": {"format": "json"}}, "text.format"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "a",
                                  "output": 5}]}, "input[0].output"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "a", "name": "f"}]},
     "input[0].arguments"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ("/v1/responses", {"input": [{"type": "computer_call"}]}, "input[0].type"),
    ("/v1/responses", {"input": 5}, "input"),
    ("/v1/responses/input_tokens", {"input": "hi", "text": {"format": "json"}},
     "text.format"),
])
def test_a_malformed_shape_on_an_agents_route_is_a_400_naming_it(fake, path, body, param):
    """Each of these answered 500 with Python's exception text."""
    r = post(fake, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "Error:" not in err["message"], err


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", **{
        f"k{i}": 1 for i in range(100)}}]}, "messages[0]"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {f"k{i}": 1
                                                               for i in range(5000)}},
     "chat_template_kwargs"),
    ("/v1/responses", {"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}},
     "metadata"),
    ("/detokenize", {"tokens": [1] * 1_100_000}, "tokens"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a"}] * 20_000},
     "messages"),
])
def test_counts_past_their_bounds_are_400s(fake, path, body, param):
    """Counts held before validation (each item costs the event loop microseconds: one
    message of 700,000 fields held it 1.1 s), and a number no vocabulary reaches."""
    r = post(fake, path, body)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param, r.text[:300]


def test_a_renderer_that_stays_busy_is_a_503_not_a_400():
    """Every template process busy: the request's plan (a tools request probes the
    template) and its render wait off the event loop, then a 503."""
    with serve(key=KEY, template="{{ messages[0].content }}") as client:
        pool = client.state.renderers
        pool.wait_s = 0.2
        held = [pool.one() for _ in pool.hosts]
        for h in held:
            h.__enter__()
        try:
            for body in (CHAT, {**CHAT, "tools": WEATHER}):
                r = post(client, "/v1/chat/completions", body)
                assert r.status_code == 503 and r.headers["retry-after"], r.text
        finally:
            for h in held:
                h.__exit__(None, None, None)
        r = post(client, "/v1/chat/completions", CHAT)
        assert r.status_code == 200, r.text


def test_a_template_whose_probe_runs_over_is_probed_once():
    """Its probes overrun: cached as a template that renders no calls (it was probed again,
    on the event loop, for every tools request: 1.9 s each)."""
    from specli import prompt

    slow = ('{% if tools and tools[0].function.name == "FFF_FIRST_FUN_F" %}'  # the probe's
            '{% set x = ("ab" * 8000000) | list | sort %}{% endif %}'
            "{{ messages[0].content }}")
    with serve(key=KEY, template=slow) as client:  # (apply-template: no grammar to check)
        t0 = time.monotonic()
        r = post(client, "/apply-template", {**CHAT, "tools": WEATHER})
        first = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert prompt.template_caps(slow) == (False, False, False)
        t0 = time.monotonic()
        r = post(client, "/apply-template", {**CHAT, "tools": WEATHER})
        assert r.status_code == 200 and time.monotonic() - t0 < min(1.0, first), r.text


def test_a_template_that_spells_a_lone_surrogate_is_a_400():
    with serve(key=KEY, template='{{ "\\ud800" }}{{ messages[0].content }}') as client:
        r = post(client, "/apply-template", CHAT)
        assert r.status_code == 400 and "not valid Unicode" in r.text, r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses",
                                  "/v1/messages/count_tokens", "/v1/responses/input_tokens"])
def test_a_body_nested_past_the_decoder_is_a_400(fake, path):
    r = post(fake, path, "[" * 100_000 + "]" * 100_000)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": ""}] * 250_000}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": ""}] * 500}] * 500}),
    ("/v1/messages", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": ""}] * 250_000}]}),
    ("/v1/messages", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": [
            {"type": "text", "text": ""}] * 250_000}]}]}),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": ""}] * 200_000}]}),  # (8 MB is the body limit)
])
def test_a_request_of_a_quarter_million_parts_is_refused_before_validation(fake, path, body):
    """Parts are counted before any is validated (250,000 empty text parts held the event
    loop 1.4 s each; the same bytes as one string, 0.28 s): a 400 naming the count, with the
    loop's time for it spent on the JSON, not on the parts."""
    raw = json.dumps(body)
    t0 = time.perf_counter()
    r = post(fake, path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "too many content parts in all: at most 16384" in err["message"], err
    assert err["param"] in ("messages", "input"), err
    assert time.perf_counter() - t0 < 5.0  # the refusal itself is microseconds


# -- 5. no schema or docs for strangers ---------------------------------------------------------

def test_docs_are_off_and_the_schema_is_behind_the_key(fake):
    with fake.anon() as anon:
        for path in ("/docs", "/redoc"):
            assert anon.get(path).status_code in (401, 404)
            assert fake.get(path).status_code == 404
        assert anon.get("/openapi.json").status_code == 401
        r = fake.get("/openapi.json")
        assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]


# -- 6. a JSON body without a JSON content type (curl -d) ---------------------------------------

@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded",
                                          "text/plain"])
def test_json_without_a_json_content_type_is_parsed(fake, content_type):
    headers = {"Authorization": f"Bearer {KEY}"}
    if content_type:
        headers["Content-Type"] = content_type
    with fake.anon() as anon:  # no Content-Type of its own
        r = anon.post("/completion", headers=headers,
                      content=json.dumps({"prompt": "hi", "n_predict": 2}).encode())
    assert r.status_code == 200, r.text
    assert "content" in r.json()


# -- 10. NaN weights: a 500 that says so, and the slot is free again ----------------------------

def test_nan_logits_are_a_500_and_the_slot_recovers(tmp_path, q4_1):
    s = InProcess("-m", with_nan(q4_1, tmp_path / "nan.gguf"), "-c", "256")
    try:
        for _ in range(2):
            r = post(s, "/completion", {"prompt": "hi", "n_predict": 4})
            assert r.status_code == 500
            assert "NaN or infinite logits at token 1" in r.json()["error"]["message"]
            with httpx.Client(verify=False, base_url=s.url) as h:
                assert h.get("/health").json()["slots_idle"] == 1
    finally:
        s.stop()
