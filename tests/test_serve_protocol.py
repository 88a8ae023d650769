"""llama-server's protocol details (issue 22): CORS, /completions as llama-server's own,
llama-server's fields on /v1/completions, ignore_eos, response_fields, system_fingerprint,
/metrics when off. CORS needs no model: the app answers a preflight before anything else."""

from __future__ import annotations

import asyncio
from contextlib import nullcontext

import pytest
from fakeserver import config, serve
from fastapi.testclient import TestClient

from specli.config import ModelParams
from specli.server.app import ServerConfig, State, create_app

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def server():
    """The app in process on fake engines (the protocol, not the text, is under test), an
    end of generation likely enough that "Say hi." stops at one (after 12 tokens)."""
    with serve(eog_bias=3.0) as client:
        client.http = lambda: nullcontext(client)
        yield client


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


def test_completions_without_v1_is_llama_servers_own(server):
    with server.http() as h:
        r = h.post("/completions", json={"prompt": PROMPT, "n_predict": 4}).json()
        assert "content" in r and r["tokens_predicted"] <= 4
        v1 = h.post("/v1/completions", json={"prompt": PROMPT, "n_predict": 4,
                                              "return_tokens": True,
                                              "cache_prompt": False}).json()
        choice = v1["choices"][0]
        assert choice["text"] == r["content"] and len(choice["tokens"]) == 4
        assert v1["system_fingerprint"].endswith("-specli")


def test_ignore_eos_and_response_fields(server):
    with server.http() as h:
        short = h.post("/completion", json={"prompt": "Say hi.", "n_predict": 200}).json()
        assert short["stop_type"] == "eos"
        n = short["tokens_predicted"] + 8
        long = h.post("/completion", json={"prompt": "Say hi.", "n_predict": n,
                                           "ignore_eos": True}).json()
        assert long["tokens_predicted"] == n and long["stop_type"] == "limit"
        # the end-of-generation bans, -inf written as null, as llama-server writes them
        bans = long["generation_settings"]["logit_bias"]
        assert bans and all(b["bias"] is None for b in bans), bans
        assert short["generation_settings"]["logit_bias"] == []
        picked = h.post("/completion", json={
            "prompt": PROMPT, "n_predict": 3,
            "response_fields": ["content", "generation_settings/n_predict", "prompt",
                                "no/such"]}).json()
        assert set(picked) == {"content", "generation_settings/n_predict", "prompt"}
        assert picked["generation_settings/n_predict"] == 3
        assert picked["prompt"].endswith(PROMPT)


def test_metrics_when_off_is_501(server):
    with server.http() as h:
        r = h.get("/metrics")
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_stream_chunks_carry_their_tokens_and_verbose_shows_the_prompt(server):
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


# -- timings as llama-server computes them (part 3) ----------------------------------------------

def test_timings_are_numbers_and_the_rate_starts_after_the_first_step():
    from specli.server import formats
    from specli.stats import Stats

    s = Stats(n_prompt=10, t_encode_s=0.2, n_predict=11, t_decode_s=1.5, n_first=3,
              t_first_s=0.5, n_drafted=12, n_accept=6, drafted_per_pos=[4, 4, 4],
              accepted_per_pos=[3, 2, 1])
    s.target.prompt_n = 9
    t = formats.timings(s)
    assert all(isinstance(v, int | float) for v in t.values())
    # the first step's time is the prompt's (llama-server: the first token comes with it)
    assert t["prompt_ms"] == pytest.approx(700) and t["prompt_n"] == 10
    assert t["predicted_ms"] == pytest.approx(1000)
    assert t["predicted_per_second"] == pytest.approx(8.0)  # 8 tokens after the first 3
    assert t["predicted_per_token_ms"] == pytest.approx(125)
    assert formats.speculative(s)["accepted_per_position"] == [0.75, 0.5, 0.25]
    # a one-token answer, or a stop string inside the first step: no token after the
    # first, so no rate (llama-server's test_metrics_generation_rate_excludes_first_token),
    # never a negative one
    s.n_predict = s.n_first = 1
    t = formats.timings(s)
    assert t["predicted_per_second"] == 0.0 and t["predicted_per_token_ms"] == 0.0
    assert t["predicted_ms"] == 0.0 and t["predicted_n"] == 1


def test_without_jinja_a_template_llama_cpp_does_not_know_is_chatml():
    from specli.backend import apply_builtin_template
    from specli.prompt import chat_renderer

    msgs = [{"role": "user", "content": "hi"}]
    source, builtin = chat_renderer("{{ 'a template no heuristic knows' }}", jinja=False)
    assert source is None and builtin(msgs, True) == apply_builtin_template("chatml", msgs)
    source, builtin = chat_renderer("llama3", jinja=True)  # a name: llama.cpp's renderer
    assert builtin(msgs, True).startswith("<|start_header_id|>user")
    assert chat_renderer("{{ x }}", jinja=True) == ("{{ x }}", None)  # Jinja source


# -- routes specli does not serve (part 9) -------------------------------------------------------

@pytest.mark.parametrize("method,path", [("POST", "/infill"), ("POST", "/v1/embeddings"),
                                         ("POST", "/embedding"), ("GET", "/"),
                                         ("POST", "/v1/rerank"), ("POST", "/slots/0"),
                                         ("GET", "/cors-proxy")])
def test_llama_server_routes_specli_does_not_serve_say_so(method, path):
    r = cors_client().request(method, path, json={})
    assert r.status_code == 501
    err = r.json()["error"]
    assert err["type"] == "not_supported_error" and path in err["message"]
    assert "specli does not implement" in err["message"]


def test_every_route_not_served_is_in_the_readme():
    from pathlib import Path

    from specli.server.routes import NOT_SERVED

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    missing = [p for _, p in NOT_SERVED if f"`{p}`" not in readme]
    assert not missing, missing


# -- several aliases and the slot choice (part 8) ------------------------------------------------

def test_several_aliases_name_the_model():
    from specli.cli.serve import names

    # llama-server keeps -a and --tags as sets: the model's id is the first alias in
    # alphabetical order (its test_server_model_aliases_and_tags)
    assert names("tinyllama-2, fim,code,,fim") == ("code", "fim", "tinyllama-2")
    c = cors_client(aliases=names("second,first"), tags=names("chat,fim,small"))
    models = c.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"]
    assert models[0]["id"] == "first" and models[0]["aliases"] == ["first", "second"]
    assert models[0]["tags"] == ["chat", "fim", "small"]
    assert cors_client().get("/v1/models", headers={"Authorization": "Bearer k"}
                             ).json()["data"][0]["tags"] == []


def _slot(i: int, tokens: list[int], last_used: float = 0.0, busy: bool = False):
    from types import SimpleNamespace

    from specli.server.slots import Slot

    return Slot(i, SimpleNamespace(target=SimpleNamespace(tokens=tokens), draft_model=None),
                busy=busy, last_used=last_used)


def test_slot_choice_keeps_the_busy_sequences_together():
    """With a cache stream a sequence llama.cpp decodes only consecutive sequences in one
    graph run: the idle slot chosen is the one that leaves the fewest runs of busy ids."""
    from specli.server.slots import SlotPool

    slots = [_slot(i, [], busy=i in (0, 1, 3)) for i in range(6)]
    pool = SlotPool(slots)
    idle = [s for s in slots if not s.busy]
    assert pool.choose(idle, [7, 8]).id == 2  # fills the gap: 0-3 one run
    for s in slots:
        s.busy = s.id == 5
    assert pool.choose([s for s in slots if not s.busy], [7, 8]).id == 4  # beside it, not 0
    for s in slots:
        s.busy = False
    assert pool.choose(slots[::-1], []).id == 0  # all idle: the lowest id
    pool.executor.shutdown()


def test_slot_choice_reuses_the_most_similar_cache_as_llama_server_does(monkeypatch):
    """llama-server's prompt similarity decides whose cache serves: the idle slot holding
    the largest fraction of the prompt, above the threshold. Where caches can move, the
    request runs in the slot that keeps the sequences together, on a copy of that cache
    (Slot.source); where they cannot, that slot itself serves."""
    from specli import batching
    from specli.server.slots import SlotPool

    prompt = list(range(20))
    empty, tenth, half = _slot(0, []), _slot(1, prompt[:2]), _slot(2, prompt[:10] + [99])
    pool = SlotPool([empty, tenth, half])
    assert pool.choose([empty, tenth, half], prompt) is half  # 50% shared, caches fixed
    assert pool.choose([empty, tenth], prompt) is empty  # 10% is not above 0.1
    monkeypatch.setattr(batching, "movable", lambda dst, src: True)
    got = pool.choose([empty, tenth, half], prompt)
    assert got is empty and got.source is half  # half's cache, copied into slot 0
    assert pool.choose([tenth, half], prompt) is tenth and tenth.source is half
    half.engine.target.tokens = prompt[:2]  # no more than the chosen slot holds: no copy
    assert pool.choose([tenth, half], prompt) is tenth and tenth.source is None
    pool.similarity = 0.6
    half.engine.target.tokens = prompt[:10]
    assert pool.choose([empty, half], prompt) is empty and empty.source is None  # 50% < 60%
    pool.similarity = 0.0  # off: the cache plays no part
    assert pool.choose([empty, half], prompt) is empty and empty.source is None
    pool.executor.shutdown()


# -- images, --chat-template, --host (parts 6 and 8) ---------------------------------------------

def test_an_image_part_is_a_400_that_says_images_are_not_supported(server):
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"].startswith("image input is not supported")
    assert err["message"].endswith("(an image_url part)")  # the article fits the word
    assert err["param"] == "messages[0].content[1]"


def test_a_live_unix_socket_is_not_taken_over(tmp_path):
    import socket

    from conftest import specli

    path = str(tmp_path / "live.sock")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    live.listen(1)
    try:
        r = specli("serve", "--host", path)
    finally:
        live.close()
    assert r.returncode == 2 and "another server is listening" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args,words", [
    (["--no-jinja", "--chat-template", "{{ messages }}"], "not supported"),
    (["--chat-template", "{% for m in messages %}"], "not supported"),
    (["--chat-template-file", "/no/such/template.jinja"], "cannot read"),
    (["--chat-template", "chatml", "--chat-template-file", "x.jinja"], "not both"),
    (["--host", "127.0.0.1,::1", "--port", "0"], "several TCP"),
    (["--host", " , "], "at least one"),
    (["-sps", "1.5"], "between 0 and 1"),
])
def test_bad_server_flags_are_one_line_errors_before_any_model_loads(args, words):
    from conftest import specli

    r = specli("serve", *args)
    assert r.returncode == 2, r.stderr
    assert words in r.stderr and "Traceback" not in r.stderr


def test_builtin_chat_templates_and_a_unix_socket(q4_1, tmp_path):
    import httpx
    from test_serve import Server

    from specli.backend import apply_builtin_template

    sock = str(tmp_path / "specli.sock")
    s = Server("-m", q4_1, "-c", "256", "--chat-template", "command-r",
               "--host", f"127.0.0.1,{sock}")
    try:
        msgs = [{"role": "system", "content": "You are a test."},
                {"role": "user", "content": "Hi there"}]
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock, verify=False),
                          base_url="http://specli") as h:  # the same server, on the socket
            r = h.post("/apply-template", json={"messages": msgs}).json()
            # llama.cpp's own renderer, as llama-server's --chat-template command-r
            assert r["prompt"] == ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test."
                                   "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>"
                                   "Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
                                   "<|CHATBOT_TOKEN|>")
            assert r["prompt"] == apply_builtin_template("command-r", msgs)
            assert h.get("/props").json()["chat_template"] == "command-r"
        with s.http() as h:  # a prefill through a built-in template
            r = h.post("/apply-template", json={"messages": [
                *msgs, {"role": "assistant", "content": "Hel"}]}).json()
            assert r["prompt"].endswith("<|CHATBOT_TOKEN|>Hel")
    finally:
        s.stop()
    # the socket file a stopped server leaves is replaced by the next start
    import subprocess
    import sys

    again = subprocess.Popen([sys.executable, "-m", "specli", "serve", "-m", q4_1, "-c", "256",
                              "--host", sock], stderr=subprocess.PIPE, text=True)
    try:
        assert f"listening on unix:{sock}" in again.stderr.readline()
    finally:
        again.terminate()
        again.wait(20)


def test_requests_that_arrive_together_are_held_to_the_queue_limit():
    """One idle slot and --max-queue 0: of three requests that arrive in one turn of the
    event loop, one takes the slot and two are refused (503), although none has taken the
    slot yet when the others ask; with --max-queue 1 one of them waits."""
    from specli.server.slots import Busy, SlotPool

    async def together(max_queue: int) -> list:
        pool = SlotPool([_slot(0, [], 0.0)], max_queue=max_queue)
        try:
            got = await asyncio.wait_for(asyncio.gather(
                *(pool.acquire() for _ in range(3)), return_exceptions=True), 0.5)
        except TimeoutError:
            got = None  # a request waits for the slot that nobody releases
        pool.executor.shutdown()
        return got

    got = asyncio.run(together(0))
    assert got is not None, "a request past --max-queue 0 waited for the slot"
    assert [type(g) for g in got].count(Busy) == 2 and got[0].id == 0
    assert "1 slots are busy and 0 requests wait" in str(got[1])

    async def one_waits() -> list:
        pool = SlotPool([_slot(0, [], 0.0)], max_queue=1)
        tasks = [asyncio.create_task(pool.acquire()) for _ in range(3)]
        await asyncio.sleep(0.05)
        done = [t.done() for t in tasks]
        pool.release(tasks[0].result())
        slot = await asyncio.wait_for(tasks[1], 1)
        pool.executor.shutdown()
        return [done, isinstance(tasks[2].exception(), Busy), slot.id]

    assert asyncio.run(one_waits()) == [[True, False, True], True, 0]


def test_a_generation_that_fails_frees_its_slot_before_its_reader_sees_the_error():
    """A client that reads the error and at once asks /health (or sends its next request)
    finds the slot idle: the slot goes back before the error reaches the reader, as it does
    before the last Done."""
    from specli.config import SamplingParams
    from specli.server.slots import Job, SlotPool

    def stream(*args):
        raise RuntimeError("the grammar was stopped")
        yield

    async def fail() -> tuple[bool, int]:
        slot = _slot(0, [], 0.0)
        slot.engine.stream = stream
        slot.engine.forget = lambda: None
        pool = SlotPool([slot])
        gen = pool.start(await pool.acquire(), Job([1, 2], 4, SamplingParams()))
        with pytest.raises(RuntimeError, match="grammar was stopped"):
            async for _ in gen.events():
                pass
        seen = (slot.busy, pool.idle)
        pool.executor.shutdown()
        return seen

    assert asyncio.run(fail()) == (False, 1)


def test_header_names_are_spelled_as_llama_server_spells_them():
    """Issue 60: Starlette lower-cases header names; llama.cpp's suite reads them into a
    plain dict (`"Process-Start-Time-Unix" in res.headers`), so specli sends llama-server's
    spelling (h11 writes a name as the app gives it)."""
    from specli.server.app import header_name

    with serve(config(metrics=True)) as client:
        r = client.get("/metrics", headers={"Origin": "http://localhost"})
    names = [k for k, _ in r.headers.raw]
    assert r.status_code == 200
    assert {b"Process-Start-Time-Unix", b"Content-Type",
            b"Access-Control-Allow-Origin"} <= set(names), names
    assert all(n == header_name(n) for n in names)
    assert header_name(b"www-authenticate") == b"WWW-Authenticate"


def test_serve_v_puts_llama_servers_verbose_in_every_answer():
    """llama-server -v (its suite's `server.debug`): chat and completions answers carry
    __verbose, the answer as /completion gives it, its prompt as rendered."""
    msgs = [{"role": "user", "content": "What is the best book"}]
    with serve(config(verbose=True)) as client:
        chat = client.post("/v1/chat/completions", json={"messages": msgs,
                                                         "max_tokens": 4}).json()
        text = client.post("/v1/completions", json={"prompt": "Once upon",
                                                    "max_tokens": 4}).json()
    assert "What is the best book" in chat["__verbose"]["prompt"]
    assert chat["__verbose"]["content"] == chat["choices"][0]["message"]["content"]
    assert text["__verbose"]["prompt"].endswith("Once upon")
    with serve() as client:
        plain = client.post("/v1/chat/completions", json={"messages": msgs,
                                                          "max_tokens": 4}).json()
    assert "__verbose" not in plain
