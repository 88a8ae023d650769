"""What applications send to llama-server, through the `openai` package and raw HTTP (issue
18): logit bias and penalties, each with speculation on giving the text it gives off;
/tokenize and /detokenize. One server on the real SmolLM2 family: F16 target, Q4_1 draft,
greedy by default; what the model's text does not decide, in process on fake engines."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse
from contextlib import nullcontext

import openai
import pytest
from fakeserver import config, serve
from test_serve import KEY, InProcess, Server

from specli.config import ModelParams

PROMPT = "List the days of the week, one per line."


@pytest.fixture(scope="module")
def server(f16, q4_1):
    # --draft 8: these tests check what speculation does (serve's default may measure that
    # drafting does not pay on a loaded machine, and not draft)
    s = InProcess("-m", f16, "-md", q4_1, "-np", "2", "-c", "1024", "--api-key", KEY,
                  "-a", "smollm2-f16", "--temp", "0", "--draft", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fake():
    """The app in process on fake engines, shaped as `server` (two slots of 512 tokens, a
    draft): for what the model's text does not decide."""
    with serve(config(target=ModelParams(path="fake.gguf", n_ctx=1024), parallel=2,
                      draft=True, api_keys=(KEY,)), key=KEY) as client:
        client.client = client.openai
        client.http = lambda: nullcontext(client)
        yield client


def chat(client: openai.OpenAI, speculative: bool = True, **kw):
    extra = kw.pop("extra_body", None) or {}
    return client.chat.completions.create(
        model="smollm2-f16", messages=[{"role": "user", "content": PROMPT}],
        max_tokens=kw.pop("max_tokens", 40), extra_body={**extra, "speculative": speculative},
        **kw)


def both(client: openai.OpenAI, **kw) -> str:
    """The text with speculation off, after checking speculation on gives the same."""
    off = chat(client, speculative=False, **kw)
    on = chat(client, **kw)
    assert on.choices[0].message.content == off.choices[0].message.content, kw
    assert on.usage.model_extra["speculative"]["draft_n"] > 0, "it did speculate"
    return off.choices[0].message.content


def tokenize(server: Server, text: str, **kw) -> list:
    with server.http() as h:
        r = h.post("/tokenize", json={"content": text, **kw})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# -- /tokenize, /detokenize (part 6) -----------------------------------------------------------

def test_tokenize_and_detokenize_round_trip(server):
    ids = tokenize(server, "Hello, world!")
    assert ids and all(isinstance(t, int) for t in ids)
    pieces = tokenize(server, "Hello, world!", with_pieces=True)
    assert [p["id"] for p in pieces] == ids
    assert "".join(p["piece"] for p in pieces) == "Hello, world!"
    with server.http() as h:
        assert h.post("/detokenize", json={"tokens": ids}).json() == {"content":
                                                                       "Hello, world!"}
        mixed = h.post("/tokenize", json={"content": ["Hello", ids[1], " world"]}).json()
        assert mixed["tokens"][1] == ids[1]
        r = h.post("/detokenize", json={"tokens": [10**9]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_a_piece_that_is_not_utf8_alone_comes_as_bytes(server):
    pieces = tokenize(server, "🦙", with_pieces=True)
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else
                   p["piece"].encode() for p in pieces)
    assert raw.decode() == "🦙"


# -- logit bias and penalties (part 3) ---------------------------------------------------------

def test_logit_bias_bans_in_every_form_and_keeps_the_text_exact(server):
    client = server.client()
    base = both(client)
    assert "Monday" in base
    ids = tokenize(server, " Monday") + tokenize(server, "Monday")
    banned = both(client, logit_bias={str(t): -100 for t in ids})
    assert "Monday" not in banned
    with server.http() as h:  # llama-server's own forms: text keys, pairs, false
        for bias in ({" Monday": False, "Monday": False},
                     [[" Monday", False], [ids[-1], -100]]):
            r = h.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40,
                "logit_bias": bias})
            assert r.json()["choices"][0]["message"]["content"] == banned, bias


def test_penalties_change_the_text_and_keep_it_exact(server):
    client = server.client()
    base = both(client, max_tokens=60)
    penalized = both(client, max_tokens=60, presence_penalty=1.5, frequency_penalty=0.5)
    assert penalized != base
    with server.http() as h:
        r = h.post("/completion", json={"prompt": PROMPT, "n_predict": 40,
                                        "repeat_penalty": 1.5, "repeat_last_n": -1})
        off = h.post("/completion", json={"prompt": PROMPT, "n_predict": 40,
                                          "repeat_penalty": 1.5, "repeat_last_n": -1,
                                          "speculative": False})
        plain = h.post("/completion", json={"prompt": PROMPT, "n_predict": 40})
    assert r.json()["content"] == off.json()["content"] != plain.json()["content"]
    assert r.json()["timings"]["draft_n"] > 0


@pytest.mark.parametrize("body,param", [
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "up"}}, "logit_bias"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"),
    ({"mirostat": 2}, "mirostat"),
    ({"xtc_probability": 0.5}, "xtc_probability"),
])
def test_bad_transforms_are_a_400_naming_the_parameter(fake, body, param):
    with fake.http() as h:
        r = h.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


# -- structured output (part 1) ----------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"day": {"type": "string"},
                                           "number": {"type": "integer"}},
          "required": ["day", "number"]}


def test_json_schema_response_format_gives_fitting_json_with_speculation(server):
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "day", "schema": SCHEMA}}
    text = both(client, response_format=fmt, max_tokens=60)
    doc = json.loads(text)
    assert set(doc) == {"day", "number"} and isinstance(doc["number"], int)
    obj = both(client, response_format={"type": "json_object"}, max_tokens=60)
    assert isinstance(json.loads(obj), dict)


def test_completion_grammar_and_json_schema(server):
    with server.http() as h:
        r = h.post("/completion", json={"prompt": "Is the sky blue? Answer:", "n_predict": 8,
                                        "grammar": 'root ::= " " ("yes" | "no") "."'})
        assert r.status_code == 200, r.text
        assert r.json()["content"] in (" yes.", " no.")
        r = h.post("/completion", json={"prompt": PROMPT, "n_predict": 60,
                                        "json_schema": SCHEMA})
        assert set(json.loads(r.json()["content"])) == {"day", "number"}


@pytest.mark.parametrize("body,param", [
    ({"grammar": 'root ::= "unterminated'}, "grammar"),
    ({"grammar": "root ::= " + "(" * 10000 + '"a"' + ")" * 10000}, "grammar"),
    ({"grammar": 'root ::= "a"', "json_schema": {}}, "grammar"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"$ref": "#/nowhere"}}}}, "response_format"),
])
def test_bad_grammars_are_a_400_naming_the_parameter(server, body, param):
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# -- log-probabilities (part 2) ----------------------------------------------------------------

def test_chat_logprobs_are_the_targets_and_match_without_speculation(server):
    client = server.client()
    on = chat(client, logprobs=True, top_logprobs=3)
    off = chat(client, speculative=False, logprobs=True, top_logprobs=3)
    assert on.usage.model_extra["speculative"]["draft_n_accepted"] > 0
    content = on.choices[0].logprobs.content
    assert "".join(t.token for t in content) == on.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True)
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen is the most likely
        assert bytes(t.bytes).decode(errors="ignore") == t.token
    # the verified rows are the target's own: within batched-decode noise of plain decoding
    for a, b in zip(content, off.choices[0].logprobs.content, strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 0.05


def test_streamed_logprobs_cover_the_text(server):
    pieces, lps = [], []
    for chunk in chat(server.client(), logprobs=True, stream=True):
        c = chunk.choices[0]
        pieces.append(c.delta.content or "")
        if c.logprobs is not None:
            lps += c.logprobs.content
    assert pieces and "".join(t.token for t in lps) == "".join(pieces)
    assert all(t.top_logprobs == [] for t in lps)


def test_completions_logprobs_in_the_legacy_form(server):
    r = server.client().completions.create(model="smollm2-f16", prompt="def add(a, b):",
                                           max_tokens=12, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_n_probs_and_post_sampling_probs_on_completion(server):
    with server.http() as h:
        r = h.post("/completion", json={"prompt": PROMPT, "n_predict": 8, "n_probs": 4,
                                        "return_tokens": True}).json()
        probs = r["completion_probabilities"]
        assert len(probs) == len(r["tokens"]) == r["tokens_predicted"]
        assert [p["id"] for p in probs] == r["tokens"]
        assert all(len(p["top_logprobs"]) == 4 for p in probs)
        post = h.post("/completion", json={"prompt": PROMPT, "n_predict": 8, "n_probs": 4,
                                           "post_sampling_probs": True}).json()
        first = post["completion_probabilities"][0]
        assert first["prob"] == 1.0 and first["top_probs"][0]["prob"] == 1.0  # greedy
        hot = h.post("/completion", json={"prompt": PROMPT, "n_predict": 8, "n_probs": 4,
                                          "post_sampling_probs": True, "temperature": 1.0,
                                          "top_k": 4, "seed": 1}).json()
        for p in hot["completion_probabilities"]:
            tops = [t["prob"] for t in p["top_probs"]]
            assert 0 < p["prob"] <= 1 and len(tops) <= 4 and abs(sum(tops) - 1) < 1e-4


# -- n choices (part 4) ------------------------------------------------------------------------

def test_n_choices_each_with_its_own_seed_on_both_routes(fake):
    client = fake.client()
    r = chat(client, n=3, temperature=1.0, seed=7, max_tokens=16)
    texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    one = [chat(client, temperature=1.0, seed=7 + i, max_tokens=16).choices[0].message.content
           for i in range(3)]
    assert texts == one, "choice i is the answer with seed + i"
    assert r.usage.completion_tokens == sum(
        chat(client, temperature=1.0, seed=7 + i, max_tokens=16).usage.completion_tokens
        for i in range(3))
    c = client.completions.create(model="smollm2-f16", prompt="Once upon a time", n=2,
                                  max_tokens=8, temperature=1.0, seed=3)
    assert sorted(x.index for x in c.choices) == [0, 1]


def test_n_choices_stream_with_their_indexes(fake):
    text: dict[int, str] = {}
    finished = set()
    for chunk in chat(fake.client(), n=2, stream=True, max_tokens=12, temperature=0):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and text[0] == text[1]  # greedy: the same answer twice


# -- chat details (part 6) ---------------------------------------------------------------------

def test_a_final_assistant_message_is_continued(server):
    msgs = [{"role": "user", "content": PROMPT},
            {"role": "assistant", "content": "Sure! 1. Monday\n2."}]
    with server.http() as h:
        prompt = h.post("/apply-template", json={"messages": msgs}).json()["prompt"]
        assert prompt.endswith("Sure! 1. Monday\n2.")  # no end of turn after the prefill
        plain = h.post("/apply-template", json={"messages": msgs[:1]}).json()["prompt"]
        assert prompt.startswith(plain)
        r = h.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4}).json()
        assert "Tuesday" in r["choices"][0]["message"]["content"]
        same = h.post("/completion", json={"prompt": prompt, "n_predict": 4}).json()
        assert same["content"] == r["choices"][0]["message"]["content"]
        two = h.post("/v1/chat/completions", json={"messages": [*msgs, msgs[1]]})
        assert two.status_code == 400 and "2 or more assistant" in two.json()["error"]["message"]
        both_ = h.post("/v1/chat/completions", json={
            "messages": msgs, "continue_final_message": True, "add_generation_prompt": True})
        assert both_.status_code == 400


def test_context_overflow_in_llama_servers_form(fake):
    many = [{"role": "system", "content": "Book"},
            {"role": "user", "content": "What is the best book"}] * 100
    with fake.http() as h:
        for stream in (False, True):
            r = h.post("/v1/chat/completions", json={"messages": many, "stream": stream})
            err = r.json()["error"]
            assert r.status_code == 400 and err["type"] == "exceed_context_size_error"
            assert err["n_prompt_tokens"] > err["n_ctx"] == 1024 // 2


def test_slots_timings_per_token_and_progress(fake):
    with fake.http() as h:
        slots = h.get("/slots").json()
        assert [s["id"] for s in slots] == [0, 1] and slots[0]["n_ctx"] == 512
        # llama-server: a slot that has served nothing has no params
        assert not any("params" in s for s in slots if not s["n_requests"])
        with h.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "This is a test " * 10}],
                "max_tokens": 6, "stream": True, "timings_per_token": True,
                "return_progress": True, "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        served = [s for s, b in zip(h.get("/slots").json(), slots, strict=True)
                  if s["n_requests"] > b["n_requests"]]  # the slot that served it
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert len(served) == 1 and served[0]["params"]["n_predict"] == 6
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress[0]["processed"] == progress[0]["cache"]
    assert progress[-1]["processed"] == progress[-1]["total"] > 0
    # with timings_per_token the progress chunks carry the timings so far (llama-server's
    # test_metrics_timings_on_prompt_progress): zeros first, never null, never backwards
    timed = [e["timings"] for e in events if "prompt_progress" in e]
    assert len(timed) == len(progress) and timed[0]["prompt_n"] == 0
    assert timed[0]["prompt_ms"] == 0.0 and timed[0]["predicted_ms"] == 0.0
    assert all(v is not None and v >= 0 for t in timed for v in t.values())
    assert [t["prompt_ms"] for t in timed] == sorted(t["prompt_ms"] for t in timed)
    assert timed[-1]["prompt_n"] == progress[-1]["processed"] - progress[-1]["cache"]
    content = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert content and all("timings" in e for e in content)
    assert events[-1]["usage"]["completion_tokens"] <= 6 and "timings" in events[-1]


def test_dry_on_the_server_keeps_the_text_exact(server):
    client = server.client()
    base = both(client, max_tokens=60)
    dry = both(client, max_tokens=60, extra_body={"dry_multiplier": 2.0,
                                                  "dry_allowed_length": 1})
    assert dry != base


def test_samplers_specli_lacks_are_accepted_at_their_neutral_values(fake):
    """What llama.cpp front-ends send by default must not be refused."""
    with fake.http() as h:
        r = h.post("/completion", json={"prompt": "Hi", "n_predict": 2, "mirostat": 0,
                                        "typical_p": 1.0, "xtc_probability": 0.0,
                                        "top_n_sigma": -1.0, "dynatemp_range": 0.0})
    assert r.status_code == 200, r.text


# -- slots and prompt forms (parts 5 and 6) ----------------------------------------------------

def test_a_prompt_goes_to_the_slot_that_holds_its_prefix(server):
    with server.http() as h:
        first = h.post("/completion", json={"prompt": PROMPT + " Then the months.",
                                            "n_predict": 2}).json()
        for _ in range(3):  # whichever slot is least used, the cache decides
            again = h.post("/completion", json={"prompt": PROMPT + " Then the months.",
                                                "n_predict": 2}).json()
            assert again["id_slot"] == first["id_slot"]
            assert again["timings"]["cache_n"] == again["tokens_evaluated"] - 1
        other = 1 - first["id_slot"]
        r = h.post("/completion", json={"prompt": PROMPT, "n_predict": 2, "id_slot": other})
        assert r.json()["id_slot"] == other
        bad = h.post("/completion", json={"prompt": PROMPT, "id_slot": 7})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "id_slot"


def test_a_cached_prompt_moves_to_the_slot_that_keeps_the_sequences_together(server):
    """A prompt cached in slot 1 serves a request that runs in slot 0 (the lowest idle id,
    which keeps the busy sequences consecutive): slot 1's cache, target's and draft's, is
    copied into slot 0 first, so the prompt is not evaluated again, and the text is the
    same."""
    body = {"prompt": PROMPT + " Then the seasons.", "n_predict": 8, "cache_prompt": True}
    with server.http() as h:
        h.post("/completion", json={"prompt": "Hello", "n_predict": 1, "id_slot": 0})
        first = h.post("/completion", json={**body, "id_slot": 1}).json()
        assert first["id_slot"] == 1
        moved = h.post("/completion", json=body).json()
    assert moved["id_slot"] == 0
    assert moved["timings"]["cache_n"] == moved["tokens_evaluated"] - 1
    assert moved["content"] == first["content"]


class _SlowToFinish:
    """An executor whose threads linger after each generation's work, as a thread does that
    waits for the GIL while the loop answers its client."""

    def __init__(self, inner):
        self.inner = inner

    def submit(self, fn, *args):
        def work():
            try:
                return fn(*args)
            finally:
                time.sleep(0.3)
        return self.inner.submit(work)

    def shutdown(self, *args, **kw):
        self.inner.shutdown(*args, **kw)


def test_a_slot_is_free_when_its_answer_arrives():
    """A client's next request, sent as soon as an answer arrives, finds that answer's slot
    idle and its prompt cached: the slot goes back before the last event is sent, not when
    the generation's thread ends (a full run once saw the next request go to the other slot)."""
    with serve(config(target=ModelParams(path="fake.gguf", n_ctx=1024), parallel=2,
                      draft=True, api_keys=(KEY,)), key=KEY) as client:
        pool = client.state.pool
        pool.executor = _SlowToFinish(pool.executor)
        body = {"prompt": PROMPT + " Then the months.", "n_predict": 2}
        first = client.post("/completion", json=body).json()
        for stream in (False, True, False):
            assert pool.idle == 2
            r = client.post("/completion", json={**body, "stream": stream})
            assert r.status_code == 200
            again = json.loads(r.text.strip().splitlines()[-1].removeprefix("data: "))
            assert again["id_slot"] == first["id_slot"], again


def test_llama_servers_prompt_forms(server):
    with server.http() as h:
        ids = h.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()[
            "tokens"]
        one = h.post("/completion", json={"prompt": ids, "n_predict": 4}).json()
        batch = h.post("/completion", json={"prompt": [ids, PROMPT, {"prompt_string": PROMPT}],
                                            "n_predict": 4}).json()
        assert [b["index"] for b in batch] == [0, 1, 2]
        assert {b["content"] for b in batch} == {one["content"]}
        mixed = h.post("/completion", json={"prompt": [*ids[:3], " the week", 13],
                                            "n_predict": 2})
        assert mixed.status_code == 200 and isinstance(mixed.json()["content"], str)
        media = h.post("/completion", json={"prompt": {"prompt_string": "<__media__>",
                                                       "multimodal_data": ["AAAA"]}})
        assert media.status_code == 400
        bare = h.post("/completion", json={"prompt": [7, {"prompt_string": PROMPT}]})
        assert bare.status_code == 400 and "prompt[0]" in bare.json()["error"]["message"]
        n = h.post("/v1/chat/completions/input_tokens", json={
            "messages": [{"role": "user", "content": PROMPT}]}).json()["input_tokens"]
        usage = h.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}).json()["usage"]
        assert n == usage["prompt_tokens"]


# -- resumable streams (issue 60 point 4; llama-server's test_stream) --------------------------

CONV = "conv-stream-test::ggml-org/tinygemma3-GGUF:Q8_0"  # test_stream's id: a slashed model
QS = "conv_id=" + urllib.parse.quote(CONV, safe="")


def test_a_named_stream_replays_from_any_offset_and_stops(fake):
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
            "stream": True}
    with fake.http() as h:
        with h.stream("POST", "/v1/chat/completions", json=body,
                      headers={"X-Conversation-Id": CONV}) as r:
            live = b"".join(r.iter_bytes())
        assert live.endswith(b"data: [DONE]\n\n") and live.count(b"data: ") > 3
        whole = h.get(f"/v1/stream?{QS}&from=0")
        assert whole.status_code == 200 and whole.content == live
        assert whole.headers["content-type"].startswith("text/event-stream")
        assert h.get(f"/v1/stream?{QS}&from=10").content == live[10:]
        assert h.get(f"/v1/stream?{QS}").content == live  # from 0 by default
        [info] = h.post("/v1/streams/lookup", json={"conversation_ids": [CONV.split("::")[0]]}
                        ).json()  # an id matches its `ID::model` streams too
        assert info["conversation_id"] == CONV and info["is_done"] is True
        assert info["total_bytes"] == len(live) and info["completed_at"] >= info["started_at"]
        assert h.post("/v1/streams/lookup", json={"conversation_ids": ["other"]}).json() == []
        assert h.post("/v1/streams/lookup", json={}).json() == []  # nothing is listed unasked
        for bad, param in (("?from=0", "conv_id"), (f"?{QS}&from=-1", "from"),
                           (f"?{QS}&from=x", "from")):
            r = h.get(f"/v1/stream{bad}")
            assert r.status_code == 400 and r.json()["error"]["param"] == param, bad
        assert h.delete(f"/v1/stream?{QS}").status_code == 204
        gone = h.get(f"/v1/stream?{QS}&from=0")
        assert gone.status_code == 404 and "not found" in gone.json()["error"]["message"]
        assert h.delete(f"/v1/stream?{QS}").status_code == 204  # idempotent, as llama-server
        # without the header a stream is not kept; a whole answer never is
        h.post("/v1/chat/completions", json=body)
        h.post("/v1/chat/completions", json={**body, "stream": False},
               headers={"X-Conversation-Id": "whole"})
        assert h.get("/v1/stream?conv_id=whole").status_code == 404
        # Messages and Responses streams are kept the same way
        for path, req in (("/v1/messages", {**body, "max_tokens": 8}),
                          ("/v1/responses", {"input": "hello", "max_output_tokens": 8,
                                             "stream": True})):
            with h.stream("POST", path, json=req, headers={"X-Conversation-Id": path}) as r:
                live = b"".join(r.iter_bytes())
            assert r.status_code == 200 and b"event: " in live
            assert h.get(f"/v1/stream?conv_id={path}").content == live, path


def test_a_named_stream_outlives_its_client_and_stop_cancels_it(server):
    """The client goes away after the first bytes: the generation runs on, and a replay
    from 0 is the whole answer, the text of the same request answered whole. Stop (DELETE)
    ends a live stream: its generation is cancelled and its client's stream ends."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 48,
            "temperature": 0}
    with server.http() as h:
        whole = h.post("/v1/chat/completions", json=body).json()
    raw = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                 b"Content-Type: application/json\r\nX-Conversation-Id: " + CONV.encode()
                 + b"\r\nContent-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    assert b"200 OK" in sock.recv(4096)  # the status line, then away
    sock.close()
    with server.http() as h:
        deadline = time.monotonic() + 60
        while b"[DONE]" not in (replay := h.get(f"/v1/stream?{QS}&from=0").content):
            assert time.monotonic() < deadline, replay[-300:]
            time.sleep(0.2)
    events = [json.loads(line[6:]) for line in replay.decode().split("\n\n")
              if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"

    got: list[bytes] = []

    def follow() -> None:
        with server.http() as h2, h2.stream(
                "POST", "/v1/chat/completions", headers={"X-Conversation-Id": CONV},
                json={**body, "max_tokens": 400, "stream": True,
                      "ignore_eos": True}) as r:
            got.extend(r.iter_bytes())

    with server.http() as h:
        before = h.get("/slots").json()
    t = threading.Thread(target=follow)
    t.start()
    with server.http() as h:
        while not got:
            time.sleep(0.05)
        assert h.delete(f"/v1/stream?{QS}").status_code == 204
        t.join(60)
        assert not t.is_alive(), "Stop ends the live client's stream"
        assert h.get(f"/v1/stream?{QS}&from=0").status_code == 404
        cut = b"".join(got)
        assert b'"finish_reason":"length"' not in cut and b"[DONE]" not in cut, \
            "the generation was cancelled before its 400 tokens"
        deadline = time.monotonic() + 30  # the slot is freed at its next token
        while any(s["is_processing"] for s in h.get("/slots").json()):
            assert time.monotonic() < deadline, "the cancelled generation holds its slot"
            time.sleep(0.05)
        [served] = [s for s, b in zip(h.get("/slots").json(), before, strict=True)
                    if s["n_requests"] > b["n_requests"]]
        assert served["n_cached"] < whole["usage"]["prompt_tokens"] + 200, \
            "Stop cancelled the generation, not only its stream"


def test_kept_streams_are_bounded_in_number_bytes_and_time(monkeypatch):
    """Finished streams go oldest first past MAX_SESSIONS or MAX_KEPT bytes, and after TTL;
    a live stream is never dropped; a new stream of a conversation cancels its old one."""
    from specli.server import streams as s

    monkeypatch.setattr(s, "MAX_SESSIONS", 3)
    monkeypatch.setattr(s, "MAX_KEPT", 100)
    now = [1000.0]
    monkeypatch.setattr(s.time, "time", lambda: now[0])
    kept = s.Streams()
    live = kept.open("live")
    for i in range(3):
        kept.open(f"done{i}").append(b"x" * 40)
        kept.sessions[f"done{i}"].finish()
        now[0] += 1
    # three finished of 40 bytes: over MAX_KEPT and, with the live one, MAX_SESSIONS
    assert kept.get("done0") is None and kept.get("live") is live
    assert sorted(kept.sessions) == ["done1", "done2", "live"]
    now[0] += s.TTL
    assert kept.get("done2") is None and kept.get("live") is live  # a live one stays
    again = kept.open("live")
    assert live.cancelled and live.done and kept.get("live") is again


def test_a_stream_stopped_before_its_task_ran_still_frees_its_generation():
    """Stop (a DELETE, or a new stream of the conversation) in the same turn of the event
    loop as the stream's start: the producer task never ran, and the generation is
    cancelled all the same."""
    import asyncio

    from specli.server import streams as s

    stopped = []

    async def never():
        await asyncio.Event().wait()
        yield ""

    async def main() -> None:
        kept = s.Streams()
        session = kept.open("c")
        reader = s.tee(never(), session, lambda: stopped.append(1))
        kept.stop("c")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [x async for x in reader] == [] and session.done

    asyncio.run(main())
    assert stopped == [1]


def test_stream_routes_refuse_bad_input_with_a_400(fake):
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
            "stream": True}
    conv = "naïve::model"  # sent as UTF-8, read back from the query string
    with fake.http() as h:
        with h.stream("POST", "/v1/chat/completions", json=body,
                      headers={"X-Conversation-Id": conv.encode()}) as r:
            live = b"".join(r.iter_bytes())
        q = urllib.parse.quote(conv, safe="")
        assert h.get(f"/v1/stream?conv_id={q}&from=").content == live  # empty: from 0
        for bad in ("²", "1" * 5000, "0x10"):
            r = h.get(f"/v1/stream?conv_id={q}&from={urllib.parse.quote(bad)}")
            assert r.status_code == 400 and r.json()["error"]["param"] == "from", bad
        deep = h.post("/v1/streams/lookup", content="[" * 100000,
                      headers={"Content-Type": "application/json"})
        assert deep.status_code == 400
        many = h.post("/v1/streams/lookup", json={"conversation_ids": [
            str(i) for i in range(1001)]})
        assert many.status_code == 400 and "1001" in many.json()["error"]["message"]
        same = h.post("/v1/streams/lookup", json={"conversation_ids": ["naïve"] * 50}).json()
        assert [x["conversation_id"] for x in same] == [conv]  # asked 50 times, said once


def test_a_continued_answer_in_parts_is_joined_as_llama_cpp_joins_it(fake):
    """llama-server's test_chat_template_assistant_prefill: the final assistant message's
    text parts continue with a blank line between them (render_content)."""
    msgs = [{"role": "user", "content": "What is the best book"},
            {"role": "assistant", "content": [{"type": "text", "text": "Wh"},
                                              {"type": "text", "text": "ill"}]}]
    with fake.http() as h:
        prompt = h.post("/apply-template", json={"messages": msgs}).json()["prompt"]
    assert prompt.endswith("Wh\n\nill")
