"""`specli serve` through real clients: the `openai` package, httpx and curl-like raw requests,
against a server started with the real SmolLM2 pair on a free loopback port (issue 5)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import nullcontext

import httpx
import openai
import pytest
from concurrency import at_once
from conftest import cli_here
from fakeserver import serve

KEY = "test-key-123"
PROMPT = "Write a Python function that adds two numbers."


class Server:
    def __init__(self, *args: str, preexec_fn=None):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specli", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            preexec_fn=preexec_fn)
        line = self._ready_line(timeout=120)
        self.port = int(re.search(r"http://127\.0\.0\.1:(\d+)", line).group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def _ready_line(self, timeout: float) -> str:
        """The `listening on` line; stderr is read on to its end after it (a line per
        request would otherwise fill the pipe and stop the server), into `log`."""
        out: list[str] = []
        self.log = out
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                out.append(line)
                if "listening on" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout)
        line = next((x for x in out if "listening on" in x), None)
        if line is None:
            self.proc.kill()
            raise RuntimeError("server did not start: " + "".join(out))
        return line

    def client(self, key: str = KEY) -> openai.OpenAI:
        # plain HTTP on loopback: no CA bundle to load (56 ms a client)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0,
                             timeout=120, http_client=httpx.Client(verify=False))

    def http(self, key: str | None = KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(verify=False, base_url=self.url, headers=headers, timeout=120)

    def rss_kb(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS")).split()[1])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def ends_on(self, sig: int = signal.SIGTERM, limit: float = 10) -> float:
        """Seconds from the signal to the process's end (an assertion past `limit`)."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        self.proc.wait(limit)
        return time.monotonic() - t0


class InProcess(Server):
    """`specli serve ARGS` in this process: the config the CLI builds from ARGS, served by
    what `specli serve` runs (cli/serve.py's `serving`: the app over real slots, uvicorn with
    the connection layer) from a thread: for the real-model server tests that are not about
    the process (it saves each a new interpreter's start), and where a test shortens the
    server's own deadlines with monkeypatch (grammar budgets, the head's timeout), which a
    server in another process would not see. Signals, exit codes and logs stay with Server."""

    def __init__(self, *args: str):
        from specli.cli import serve as command
        from specli.server import conn

        seen: dict = {}
        run, command._run = command._run, lambda config, hosts, port: seen.update(c=config)
        try:
            r = cli_here("serve", "--port", "0", *args)
        finally:
            command._run = run
        if "c" not in seen:
            raise RuntimeError(f"serve refused its arguments: {r.stderr}")
        sock = command._listen("127.0.0.1", 0)  # as `specli serve` binds it
        sock.listen()
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc, self.log = None, []
        ready = threading.Event()
        self._max_open = conn.Guarded.max_open  # serving() sets it for the process
        self.server, failure = command.serving(seen["c"], [sock], lambda n: ready.set())
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[sock])), daemon=True)
        self.thread.start()
        while not ready.wait(0.05):
            if failure or not self.thread.is_alive():
                self.stop()
                raise RuntimeError(f"server did not start: {failure}")

    def stop(self) -> None:
        from specli.server import conn

        self.server.should_exit = True
        self.thread.join(30)
        conn.Guarded.max_open = self._max_open


@pytest.fixture(scope="module")
def server(f16, q4_1):
    # --draft 8: these tests check what speculation does, so it must happen whatever the
    # machine's load makes serve's default (--draft auto) measure
    s = Server("-m", f16, "-md", q4_1, "-np", "2", "-c", "1024", "--api-key", KEY,
               "--metrics", "-a", "smollm2-f16", "--temp", "0", "--draft", "8")
    yield s
    s.stop()


def chat(client, content: str = PROMPT, **kw):
    return client.chat.completions.create(
        model="smollm2-f16", messages=[{"role": "user", "content": content}],
        max_tokens=kw.pop("max_tokens", 32), temperature=0, **kw)


# -- the openai package ------------------------------------------------------------------------

def test_chat_completion_with_usage(server):
    r = chat(server.client())
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 32
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    spec = u.model_extra["speculative"]
    assert spec["draft_n"] >= spec["draft_n_accepted"] >= 0


def test_completion(server):
    r = server.client().completions.create(model="smollm2-f16", prompt="def add(a, b):",
                                           max_tokens=16, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 16


def test_streaming_reassembles_to_the_plain_answer(server):
    client = server.client()
    plain = chat(client).choices[0].message.content
    pieces, usage = [], None
    for chunk in chat(client, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == plain
    assert usage is not None and usage.completion_tokens > 0


def test_models_list(server):
    ids = [m.id for m in server.client().models.list()]
    assert ids == ["smollm2-f16"]


def test_a_wrong_key_is_an_authentication_error(server):
    with pytest.raises(openai.AuthenticationError):
        chat(server.client(key="wrong"))
    assert server.http(key=None).get("/v1/models").status_code == 401
    r = httpx.get(f"{server.url}/v1/models", verify=False, headers={"X-Api-Key": KEY})
    assert r.status_code == 200
    assert httpx.get(f"{server.url}/health", verify=False).status_code == 200  # public


# -- greedy fidelity and per-request speculation ---------------------------------------------

def test_with_and_without_speculation_the_text_is_identical(server):
    client = server.client()
    base = chat(client, max_tokens=48, extra_body={"speculative": False})
    assert base.usage.model_extra["speculative"]["draft_n"] == 0
    for spec in (None, {"n_max": 3}, {"type": "ngram-simple"},
                 {"type": "ngram-mod,draft-simple", "n_max": 5, "p_min": 0.3}):
        r = chat(client, max_tokens=48, extra_body={"speculative": spec} if spec else None)
        assert r.choices[0].message.content == base.choices[0].message.content, spec
        if spec is None or "draft-simple" in spec.get("type", "draft-simple"):
            assert r.usage.model_extra["speculative"]["draft_n"] > 0, spec  # it did speculate


def test_per_request_n_max_caps_every_draft(server):
    with server.http() as h:
        r = h.post("/completion", json={"prompt": PROMPT, "n_predict": 32,
                                        "speculative": {"n_max": 2}}).json()
        assert r["timings"]["draft_n"] > 0
        assert len(r["speculative"]["accepted_per_position"]) <= 2
        flat = h.post("/completion", json={"prompt": PROMPT, "n_predict": 32,
                                           "speculative.n_max": 2}).json()
        assert flat["content"] == r["content"]
        assert 0 < len(flat["speculative"]["accepted_per_position"]) <= 2  # the cap held


def test_llama_server_completion_and_its_timings(server):
    with server.http() as h:
        r = h.post("/completion", json={"prompt": PROMPT, "n_predict": 24, "temperature": 0})
        assert r.status_code == 200
        doc = r.json()
        t = doc["timings"]
        for key in ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                    "predicted_per_second", "draft_n", "draft_n_accepted"):
            assert key in t, key
        assert doc["stop"] is True and doc["tokens_predicted"] == t["predicted_n"] <= 24
        # numbers only, as llama-server's; the rate counts the tokens after the first step's
        assert all(isinstance(v, int | float) for v in t.values()), t
        assert t["predicted_per_second"] > 0 and t["prompt_ms"] > 0
        assert t["predicted_per_token_ms"] * (t["predicted_n"] - 1) >= t["predicted_ms"] * 0.99
        events = []
        with h.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": 24,
                                                   "temperature": 0, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        assert "".join(e["content"] for e in events) == doc["content"]
        assert events[-1]["stop"] is True and "timings" in events[-1]


def test_stop_strings_cut_the_text(server):
    client = server.client()
    full = chat(client, max_tokens=40).choices[0].message.content
    word = full.split()[3]
    cut = chat(client, max_tokens=40, stop=[word])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.index(word)]


# -- metrics and props ---------------------------------------------------------------------------

def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_metrics_move_by_exactly_one_requests_figures(server):
    with server.http() as h:
        before = h.get("/metrics").text
        t = h.post("/completion", json={"prompt": PROMPT, "n_predict": 20}).json()["timings"]
        after = h.get("/metrics").text
    for name, value in (("specli_draft_tokens_total", t["draft_n"]),
                        ("specli_draft_tokens_accepted_total", t["draft_n_accepted"]),
                        ("specli_tokens_predicted_total", t["predicted_n"]),
                        ("specli_drafts_total", t["draft_steps"]),
                        ("specli_plain_steps_total", t["plain_steps"]),
                        # llama-server's names, for its dashboards
                        ("llamacpp:spec_decode_num_draft_tokens_total", t["draft_n"]),
                        ("llamacpp:spec_decode_num_accepted_tokens_total",
                         t["draft_n_accepted"]),
                        ("llamacpp:tokens_predicted_total", t["predicted_n"]),
                        ("llamacpp:prompt_tokens_total", t["prompt_n"]),
                        ("llamacpp:prompt_tokens_cached_total", t["cache_n"])):
        assert _metric(after, name) - _metric(before, name) == value, name
    assert 'specli_requests_total{code="200",route="/completion"}' in after
    # every step drafted or plain: each emitted its accepted tokens and one of the target's
    assert t["predicted_n"] <= t["draft_n_accepted"] + t["draft_steps"] + t["plain_steps"] \
        <= t["predicted_n"] + 1
    # the throughput gauges average over the window since the previous scrape
    assert _metric(after, "llamacpp:predicted_tokens_seconds") > 0
    assert _metric(after, "llamacpp:requests_processing") == 0
    assert 0 < _metric(after, "llamacpp:kv_cache_usage_ratio") <= 1
    # the target's llama_decode calls: a prompt's one at least, then one a step
    steps = t["draft_steps"] + t["plain_steps"]
    assert _metric(after, "llamacpp:n_decode_total") - _metric(before,
                                                              "llamacpp:n_decode_total") >= steps
    assert _metric(after, "llamacpp:n_busy_slots_per_decode") >= 1
    for name, kind in (("n_decode_total", "counter"), ("n_tokens_max", "counter"),
                       ("n_busy_slots_per_decode", "gauge")):  # llama-server's types
        assert f"# TYPE llamacpp:{name} {kind}" in after, name
    with server.http() as h:
        again = h.get("/metrics")
    assert _metric(again.text, "llamacpp:predicted_tokens_seconds") == 0  # nothing since
    assert abs(int(again.headers["Process-Start-Time-Unix"]) - time.time()) < 3600
    with server.http() as h:
        before = h.get("/metrics").text
        u = h.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 20}).json()
        after = h.get("/metrics").text
    spec = u["usage"]["speculative"]
    assert _metric(after, "specli_drafts_total") - _metric(before, "specli_drafts_total") \
        == spec["drafts"]
    assert _metric(after, "specli_plain_steps_total") \
        - _metric(before, "specli_plain_steps_total") == spec["plain_steps"]
    assert _metric(after, "specli_prompt_tokens_total") \
        - _metric(before, "specli_prompt_tokens_total") == u["usage"]["prompt_tokens"]


def test_props_state_slots_and_template(server):
    with server.http() as h:
        p = h.get("/props").json()
    assert p["total_slots"] == 2 and p["slots_idle"] == 2
    assert p["chat_template_fallback"] is False
    assert p["speculative"]["types"] == ["draft-simple"]
    assert p["default_generation_settings"]["n_ctx"] == 512  # -c 1024 over 2 slots
    params = p["default_generation_settings"]["params"]  # the server's defaults, llama's keys
    assert params["temperature"] == 0 and params["seed"] == -1 and params["n_predict"] == -1
    assert p["speculative"]["auto"] is False and p["speculative"]["n_max"] == 8  # --draft 8
    assert params["speculative.n_max"] == 8 and params["speculative.n_min"] == 0
    assert params["speculative.p_min"] == 0 and params["speculative.types"] == "draft-simple"
    assert params["samplers"][-1] == "temperature"


def test_any_model_name_is_served_as_llama_server_does(server):
    """One model served: a client's hard-coded name is answered by it, named by its alias."""
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={
            "model": "gpt-4", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "smollm2-f16"
        assert [m["id"] for m in h.get("/v1/models").json()["data"]] == ["smollm2-f16"]


# -- errors: the OpenAI envelope, 4xx for bad input ----------------------------------------------

@pytest.fixture(scope="module")
def fake():
    """The app in process on fake engines, a context of 512 tokens a slot as `server`'s: what
    is refused before a model runs."""
    with serve() as client:
        yield client


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi " * 2000}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "speculative": {"type": "magic"}},
     "speculative.type"),
])
def test_bad_input_is_a_400_in_the_openai_envelope(fake, body, param):
    r = fake.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    assert err["param"] == param, err
    if err["type"] == "exceed_context_size_error":  # llama-server's form of an overflow
        assert set(err) == {"message", "type", "param", "code", "n_prompt_tokens", "n_ctx"}
    else:
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error"


def test_invalid_json_too_large_and_unknown_routes(fake):
    with nullcontext(fake) as h:
        r = h.post("/v1/chat/completions", content=b"{not json",
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = h.post("/v1/completions", content=b"x" * (9 << 20),
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "error" in r.json()
        r = h.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()


# -- slots: concurrency, disconnects, the queue ---------------------------------------------------

def test_eight_streaming_clients_half_leaving_leak_nothing(server):
    with server.http() as h:  # warm up, then measure
        h.post("/completion", json={"prompt": PROMPT, "n_predict": 8})
    rss_before = server.rss_kb()
    errors: list[str] = []

    def client(i: int) -> None:
        try:
            with httpx.Client(verify=False, base_url=server.url, timeout=120,
                              headers={"Authorization": f"Bearer {KEY}"}) as c, \
                    c.stream("POST", "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": f"Count to {i + 20}."}],
                        "max_tokens": 48, "stream": True}) as r:
                if r.status_code != 200:
                    errors.append(f"{i}: {r.status_code}")
                    return
                for n, _ in enumerate(r.iter_lines()):
                    if i % 2 and n == 4:
                        return  # leave mid-stream: the slot must be freed at once
        except Exception as e:  # noqa: BLE001
            errors.append(f"{i}: {e!r}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors
    deadline = time.time() + 10
    while time.time() < deadline:
        health = httpx.get(f"{server.url}/health", verify=False).json()
        if health["slots_idle"] == 2:
            break
        time.sleep(0.2)
    assert health == {"status": "ok", "slots_idle": 2, "slots_processing": 0}
    assert abs(server.rss_kb() - rss_before) <= 0.1 * rss_before


def _idle_within(server, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if httpx.get(f"{server.url}/health", verify=False).json()["slots_processing"] == 0:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_frees_its_slot_at_once(server, stream):
    """400 tokens take ~8 s here: the slot must be idle long before, whichever way the
    client left (a non-streaming request too)."""
    body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": stream}
    with pytest.raises(httpx.ReadTimeout):
        with server.http() as h:
            h.timeout = httpx.Timeout(120, read=1.0 if not stream else 120)
            if stream:
                with h.stream("POST", "/v1/completions", json=body) as r:
                    for n, _ in enumerate(r.iter_lines()):
                        if n == 6:
                            raise httpx.ReadTimeout("leaving mid-stream")
            else:
                h.post("/v1/completions", json=body)
    assert _idle_within(server, 2.0)


def test_concurrent_greedy_requests_match_their_lone_answers(f32, q4_1):
    """serve's default drafting (--draft auto: /props says so) plans each slot's k for the
    batch: alone a slot drafts, 4 or 8 at once mostly decode plainly. Each request still gets
    the target's own text. (A request's speculative.n_max caps auto's k as it caps a fixed
    one: the same k reaches Adaptive.best_k, test_adaptive.) An F32 target: on F16, "Name 5
    animals" is a near tie that a batch's shape decides (`run --no-spec`, `--draft 8` and
    `--draft auto` give three texts there). F32 is not exact either: a batched decode's
    logits differ from single-token decodes' by up to 0.03 here, so "Name 5 animals" (top-two
    margin 0.0012 at its 20th token) took either word as batches fell in CI. The prompts are
    ones whose greedy 32 tokens alone never come within 0.08 of a tie (measured on this F32)."""
    s = Server("-m", f32, "-md", q4_1, "-np", "8", "-c", "4096", "--api-key", KEY,
               "-a", "smollm2-f16", "--temp", "0")
    try:
        with s.http() as h:
            spec = h.get("/props").json()["speculative"]
            assert spec["auto"] is True and spec["n_max"] == 64  # no --draft: up to 64
        prompts = [*(f"Name {n} animals that live in the sea." for n in (7, 8, 15)),
                   "Name 4 fruits.", "Name 6 fruits.",
                   *(f"List {n} colors." for n in (6, 7, 8))]

        def answer(i: int) -> str:
            return chat(s.client(), prompts[i], max_tokens=32).choices[0].message.content

        alone = [answer(i) for i in range(8)]
        assert at_once(answer, 4, 120) == alone[:4]
        assert at_once(answer, 8, 120) == alone
    finally:
        s.stop()


def test_a_full_queue_answers_503_with_retry_after(q4_1):
    s = Server("-m", q4_1, "-np", "1", "--max-queue", "0", "-c", "512")
    try:
        codes: list[int] = []
        retry: list[str | None] = []

        def call() -> None:
            r = httpx.post(f"{s.url}/completion", verify=False, timeout=120,
                           json={"prompt": PROMPT, "n_predict": 64})
            codes.append(r.status_code)
            retry.append(r.headers.get("retry-after"))

        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(codes)[0] == 200 and 503 in codes
        assert all(r == "1" for c, r in zip(codes, retry, strict=True) if c == 503)
    finally:
        s.stop()


def test_the_servers_connections_send_without_waiting_for_acks():
    """`specli serve`'s listening socket says it is TCP, so asyncio, under uvicorn, turns
    Nagle off on every connection (TCP_NODELAY). With it on, a response's body waited for the
    client's delayed ACK of its headers: 40 ms on each request of a kept-alive connection,
    which is how the openai package and llama.cpp's clients talk to a server."""
    from specli.cli.serve import _listen

    sock = _listen("127.0.0.1", 0)

    async def accepted() -> int:
        got = asyncio.get_running_loop().create_future()

        def on(reader, writer):
            got.set_result(writer.get_extra_info("socket").getsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        async with await asyncio.start_server(on, sock=sock):
            _, w = await asyncio.open_connection(*sock.getsockname()[:2])
            try:
                return await asyncio.wait_for(got, 10)
            finally:
                w.close()

    assert asyncio.run(accepted()) != 0


def test_an_incompatible_pair_is_refused_before_listening(gemma, q4_1):
    r = subprocess.run([sys.executable, "-m", "specli", "serve", "-m", gemma, "-md", q4_1,
                        "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith("error: incompatible draft/target pair (vocab-type)")


def test_a_busy_port_is_a_clear_error(server):
    r = subprocess.run([sys.executable, "-m", "specli", "serve", "--port", str(server.port)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr


def test_api_keys_from_flags_and_a_file(tmp_path):
    from specli.cli.serve import _keys
    from specli.errors import SpecliError

    f = tmp_path / "keys.txt"
    f.write_text("file-key-1\n\n  file-key-2  \n")
    assert _keys(["a,b", "c"], f) == ["a", "b", "c", "file-key-1", "file-key-2"]
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(SpecliError, match="holds no key"):
        _keys([], empty)
    with pytest.raises(SpecliError, match="cannot read --api-key-file"):
        _keys([], tmp_path / "missing.txt")


def test_an_empty_api_key_is_refused_not_an_open_server(tmp_path):
    """`--api-key "$KEY"` with KEY unset, or an empty LLAMA_API_KEY, would start the server
    without authentication: one line and exit 2 instead, before any model is read."""
    from specli.cli.serve import _keys
    from specli.errors import UsageError

    for given in ([""], ["  "], [","], ["a", ""]):
        with pytest.raises(UsageError, match="--api-key is empty"):
            _keys(given, None)
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_API_KEY"}
    for args, extra in ((["--api-key", ""], {}), ([], {"LLAMA_API_KEY": ""}),
                        ([], {"LLAMA_API_KEY": " , "})):
        r = subprocess.run([sys.executable, "-m", "specli", "serve", "-m",
                            str(tmp_path / "never-read.gguf"), "--port", "0", *args],
                           capture_output=True, text=True, timeout=60, env={**env, **extra})
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert "is empty: the server would start without authentication" in lines[0], lines
        assert len(lines) <= 2 and "Traceback" not in r.stderr  # the error and its hint
