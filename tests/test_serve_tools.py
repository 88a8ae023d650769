"""Coding agents on `specli serve` (issue 35): tool calls on /v1/chat/completions, Anthropic's
Messages and OpenAI's Responses, through the real `openai` and `anthropic` clients, on the
real SmolLM2 family, greedy (the protocol's server: the Q8_0 drafting for itself; where text
must equal the target's own: the F16 target, the Q4_1 draft). SmolLM2's template renders no tool
calls, so its tools go through the generic format (the tools in the system prompt, a JSON
answer kept to by a grammar): the protocol is under test; how each model family writes a
call is tests/test_toolcall.py's, how templates render them tests/test_templates.py's."""

from __future__ import annotations

import json

import httpx
import pytest
from test_serve import KEY, InProcess, Server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(q8_0):
    """The protocol's server: the Q8_0 (faster than the F16 and, over a long prompt of tool
    definitions, than the Q4_1 on an AVX2 CPU), drafting for itself so that every answer goes
    through speculative steps."""
    s = InProcess("-m", q8_0, "-md", q8_0, "-c", "2048", "--api-key", KEY, "--temp", "0",
                  "-a", "smollm2", "--draft", "8")  # (auto would rightly not draft)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def exact(f16, q4_1):
    """The F16 target and the Q4_1 draft: where greedy text must equal the target's own."""
    s = InProcess("-m", f16, "-md", q4_1, "-c", "1024", "--api-key", KEY, "--temp", "0",
                  "--draft", "8")  # a test of what speculation does: it must happen
    yield s
    s.stop()


def call_of(message) -> tuple[str, dict]:
    assert message.tool_calls and len(message.tool_calls) >= 1, message
    c = message.tool_calls[0]
    assert c.type == "function" and c.id
    return c.function.name, json.loads(c.function.arguments)


# -- /v1/chat/completions --------------------------------------------------------------------

def test_a_required_call_round_trip_through_the_openai_client(server):
    """A call (the tool's name, JSON arguments with its required key, an id), its result sent
    back as a tool message, then an answer in text: the agent loop."""
    client = server.client()
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER],
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    name, args = call_of(choice.message)
    assert name == "get_weather" and isinstance(args.get("city"), str)
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false: one call
    messages = [*ASK, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id,
                 "content": "Sunny, 21 C"}]
    r = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER],
                                       tool_choice="none", max_tokens=30)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


def test_a_named_function_is_the_one_called(server):
    r = server.client().chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER, TIME], max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert call_of(r.choices[0].message)[0] == "get_time"


def test_a_streamed_call_arrives_as_tool_call_deltas(server):
    chunks = list(server.client().chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required", stream=True,
        parallel_tool_calls=False, max_tokens=80, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id
    assert calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert "city" in json.loads(calls[0].function.arguments)
    assert not any(d.content for d in deltas)  # the JSON of the call is never content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None and not chunks[-1].choices


def test_a_constrained_call_is_the_same_with_speculation_on_and_off(exact):
    """The call's grammar applies to target and draft alike: greedy, the arguments are the
    target's own, token for token, and the draft was used."""
    def ask(speculative: bool):
        return exact.client().chat.completions.create(
            model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
            max_tokens=80, extra_body={"speculative": speculative})

    on, off = ask(True), ask(False)
    assert [(c.function.name, c.function.arguments) for c in on.choices[0].message.tool_calls] \
        == [(c.function.name, c.function.arguments) for c in off.choices[0].message.tool_calls]
    assert on.usage.model_extra["speculative"]["draft_n"] > 0


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"grammar": "root ::= \"x\""}, "tools"),
    ({"reasoning_format": "loud"}, "reasoning_format"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs"),
])
def test_bad_tool_requests_are_400s_that_name_the_parameter(server, body, param):
    req = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", **body}
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={k: v for k, v in req.items() if v is not None})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_apply_template_honours_add_generation_prompt_and_tools(server):
    with server.http() as h:
        on = h.post("/apply-template", json={"messages": ASK}).json()["prompt"]
        off = h.post("/apply-template", json={"messages": ASK,
                                              "add_generation_prompt": False}).json()["prompt"]
        tools = h.post("/apply-template", json={"messages": ASK, "tools": [WEATHER]}).json()
        n = h.post("/v1/chat/completions/input_tokens", json={"messages": ASK}).json()
        n_tools = h.post("/v1/chat/completions/input_tokens",
                         json={"messages": ASK, "tools": [WEATHER]}).json()
    assert on.endswith("<|im_start|>assistant\n") and on.startswith(off)
    assert not off.endswith("<|im_start|>assistant\n")
    assert "get_weather" in tools["prompt"] and "get_weather" not in on
    assert n_tools["input_tokens"] > n["input_tokens"]


# -- Anthropic's Messages --------------------------------------------------------------------

def claude(server: Server):
    import anthropic  # 1-2.5 s of imports, for this module's Messages tests only (not at
    # collection, which every xdist worker runs)

    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120,
                               http_client=anthropic.DefaultHttpxClient(verify=False))


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city",
                    "input_schema": WEATHER["function"]["parameters"]}]


def test_a_tool_use_round_trip_through_the_anthropic_client(server):
    a = claude(server)
    r = a.messages.create(model="smollm2", max_tokens=80, messages=ASK,
                          tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"})
    assert r.type == "message" and r.role == "assistant" and r.stop_reason == "tool_use"
    use = [b for b in r.content if b.type == "tool_use"]
    assert use and use[0].name == "get_weather" and isinstance(use[0].input.get("city"), str)
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    r = a.messages.create(model="smollm2", max_tokens=30, tools=ANTHROPIC_TOOLS,
                          tool_choice={"type": "none"}, messages=[
        *ASK, {"role": "assistant", "content": r.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                      "content": "Sunny, 21 C"}]}])
    assert r.content[0].type == "text" and r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_streams_its_events_in_order(server):
    with claude(server).messages.stream(model="smollm2", max_tokens=80, messages=ASK,
                                        tools=ANTHROPIC_TOOLS,
                                        tool_choice={"type": "any"}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert "city" in final.content[-1].input
    with claude(server).messages.stream(model="smollm2", max_tokens=12,
                                        messages=[{"role": "user", "content": "Say hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason == "max_tokens"


def test_a_max_tokens_beyond_the_context_runs_to_the_end(server):
    """Claude Code sends max_tokens 32000 to any model: not a 400, an answer that ends at
    the end of generation or a full context."""
    r = claude(server).messages.create(model="smollm2", max_tokens=64000, messages=[
        {"role": "user", "content": "Say hi"}], stop_sequences=[".", "!", "\n"])
    assert r.content and r.stop_reason in ("end_turn", "stop_sequence", "max_tokens")


def test_count_tokens_counts_the_prompt_with_its_tools(server):
    a = claude(server)
    plain = a.messages.count_tokens(model="smollm2", messages=ASK).input_tokens
    with_tools = a.messages.count_tokens(model="smollm2", messages=ASK,
                                         tools=ANTHROPIC_TOOLS).input_tokens
    assert 0 < plain < with_tools


def test_anthropic_errors_are_400s_and_the_key_comes_as_x_api_key(server):
    with httpx.Client(verify=False, base_url=server.url, timeout=60) as h:
        r = h.post("/v1/messages", json={"max_tokens": 5}, headers={"x-api-key": KEY})
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        r = h.post("/v1/messages", json={"messages": ASK}, headers={"x-api-key": KEY})
        assert r.status_code == 400, r.text  # Anthropic's API requires it
        assert r.json()["error"]["message"].startswith("max_tokens: Field required")
        r = h.post("/v1/messages/count_tokens", json={"messages": ASK},
                   headers={"x-api-key": KEY})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0  # there it is not
        r = h.post("/v1/messages", json={"max_tokens": 5, "messages": ASK},
                   headers={"x-api-key": "wrong"})
        assert r.status_code == 401
        r = h.post("/v1/messages", headers={"x-api-key": KEY}, json={
            "max_tokens": 5, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "AAAA"}}]}]})
        assert r.status_code == 400 and "image input is not supported" in r.text


# -- OpenAI's Responses ----------------------------------------------------------------------

RESPONSE_TOOLS = [{"type": "function", "name": "get_weather",
                   "parameters": WEATHER["function"]["parameters"]}]


def test_a_function_call_round_trip_through_the_responses_api(server):
    o = server.client()
    r = o.responses.create(model="smollm2", input="What is the weather in Paris?",
                           tools=RESPONSE_TOOLS, tool_choice="required", max_output_tokens=80)
    assert r.id.startswith("resp_") and r.status == "completed"
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert "city" in json.loads(calls[0].arguments) and calls[0].call_id
    r = o.responses.create(model="smollm2", max_output_tokens=30, input=[
        *ASK, calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}])
    assert r.output[0].type == "message" and r.output[0].id.startswith("msg_")
    assert r.output_text


def test_the_responses_stream_ends_with_the_whole_response(server):
    o = server.client()
    with o.responses.stream(model="smollm2", input="Say hi", max_output_tokens=12) as s:
        events = list(s)
        final = s.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert deltas and final.output_text == deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with o.responses.stream(model="smollm2", input="What is the weather in Paris?",
                            tools=RESPONSE_TOOLS, tool_choice="required",
                            max_output_tokens=80) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert final.output[-1].type == "function_call"


def test_responses_input_tokens_and_refusals(server):
    with server.http() as h:
        n = h.post("/v1/responses/input_tokens", json={"input": "Say hi"}).json()
        assert n["object"] == "response.input_tokens" and n["input_tokens"] > 0
        r = h.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_1"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
        r = h.post("/v1/responses", json={})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"


# -- a template family with its own call syntax ----------------------------------------------

HERMES = "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"


@pytest.fixture(scope="module")
def hermes(q8_0):
    """The Q8_0 with Hermes 2 Pro's template (tests/data/templates/): calls are written as
    <tool_call> JSON </tool_call>, under a grammar when required, a lazy one for auto."""
    from pathlib import Path

    s = InProcess("-m", q8_0, "-c", "2048", "--api-key", KEY, "--temp", "0",
                  "--chat-template-file", str(Path(__file__).parent / "data" / "templates" /
                                               HERMES))
    yield s
    s.stop()


def test_a_family_call_is_written_in_its_syntax_and_read_back(hermes):
    with hermes.http() as h:
        r = h.post("/v1/chat/completions", json={
            "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
            "max_tokens": 80, "verbose": True}).json()
    raw = r["__verbose"]["content"]
    assert raw.startswith("<tool_call>\n{") and "</tool_call>" in raw  # Hermes's own syntax
    msg = r["choices"][0]["message"]
    assert r["choices"][0]["finish_reason"] == "tool_calls" and msg["content"] is None
    assert msg["tool_calls"][0]["function"]["name"] in ("get_weather", "get_time")
    assert "city" in json.loads(msg["tool_calls"][0]["function"]["arguments"])
    with hermes.http() as h:  # the tools reach the template, in its own words
        text = h.post("/apply-template", json={"messages": ASK, "tools": [WEATHER]}).json()
    assert "<tools>" in text["prompt"] and "get_weather" in text["prompt"]


def test_auto_leaves_the_text_free_until_a_call_begins(hermes):
    """tool_choice auto: the lazy grammar waits for <tool_call>; an answer in text stays
    text, with no tool_calls."""
    r = hermes.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say hello to Bob."}],
        tools=[WEATHER], max_tokens=24)
    m = r.choices[0].message
    assert m.content and "<tool_call>" not in m.content and not m.tool_calls


# -- a call the token limit cuts short (issue 59, point 3) ----------------------------------

RESPONSE_TOOL = {"type": "function", "name": "get_weather",
                 "parameters": WEATHER["function"]["parameters"]}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}


def _events(h: httpx.Client, path: str, body: dict) -> list[dict]:
    with h.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def _chat_cut(h, n: int, stream: bool) -> tuple[str, list[tuple[str, str]], str]:
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required",
            "max_tokens": n, "parallel_tool_calls": False}
    if not stream:
        c = h.post("/v1/chat/completions", json=body).json()["choices"][0]
        calls = c["message"].get("tool_calls") or []
        return (c["message"]["content"] or "", [(t["function"]["name"],
                t["function"]["arguments"]) for t in calls], c["finish_reason"])
    text, calls, finish = "", {}, None
    for e in _events(h, "/v1/chat/completions", body):
        for c in e["choices"]:
            text += c["delta"].get("content") or ""
            for t in c["delta"].get("tool_calls") or ():
                name, args = calls.get(t["index"], ("", ""))
                calls[t["index"]] = (name + (t["function"].get("name") or ""),
                                     args + (t["function"].get("arguments") or ""))
            finish = c["finish_reason"] or finish
    return text, list(calls.values()), finish


def _messages_cut(h, n: int, stream: bool) -> tuple[str, list[tuple[str, str]], str]:
    body = {"messages": ASK, "tools": [ANTHROPIC_TOOL], "max_tokens": n,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    if not stream:
        r = h.post("/v1/messages", json=body, headers={"x-api-key": KEY}).json()
        return ("".join(b["text"] for b in r["content"] if b["type"] == "text"),
                [(b["name"], json.dumps(b["input"])) for b in r["content"]
                 if b["type"] == "tool_use"], r["stop_reason"])
    text, calls, stop = "", [], None
    for e in _events(h, "/v1/messages", body):
        if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use":
            calls.append([e["content_block"]["name"], ""])
        elif e["type"] == "content_block_delta":
            d = e["delta"]
            text += d.get("text", "")
            if d["type"] == "input_json_delta":
                calls[-1][1] += d["partial_json"]
        elif e["type"] == "message_delta":
            stop = e["delta"]["stop_reason"]
    return text, [tuple(c) for c in calls], stop


def _responses_cut(h, n: int, stream: bool) -> tuple[str, list[tuple[str, str]], str]:
    body = {"input": ASK[0]["content"], "tools": [RESPONSE_TOOL], "tool_choice": "required",
            "max_output_tokens": n, "parallel_tool_calls": False}
    if stream:
        events = _events(h, "/v1/responses", body)
        assert events[-1]["type"] == "response.completed"
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        r = events[-1]["response"]
        assert r["output"] == done  # the whole response says what the events said
    else:
        r = h.post("/v1/responses", json=body).json()
    items = r["output"]
    # the statuses agree: the response's, its last item's, the reason it gives
    assert r["status"] == "incomplete" and items[-1]["status"] == "incomplete"
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert all(i["status"] == "completed" for i in items[:-1])
    return (r["output_text"], [(i["name"], i["arguments"]) for i in items
                               if i["type"] == "function_call"], r["status"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("cut,length", [
    (_chat_cut, "length"), (_messages_cut, "max_tokens"), (_responses_cut, "incomplete")],
    ids=["chat", "messages", "responses"])
def test_a_call_cut_by_the_token_limit_is_no_text(server, cut, length, stream):
    """As llama-server and OpenAI: a call the limit cut short is never content; once its
    name is written it is the call, its arguments as far as written (no JSON yet), and the
    finish says the limit; before its name, nothing. Every API, streamed and whole."""
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as h:
        whole = h.post("/v1/chat/completions", json={
            "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 80,
            "parallel_tool_calls": False}).json()
        n = whole["usage"]["completion_tokens"]
        assert whole["choices"][0]["finish_reason"] == "tool_calls" and n > 8
        for k in range(n - 1, n - 8, -1):  # back from the end, into the arguments
            text, calls, finish = cut(h, k, stream)
            assert text == "" and finish == length, (k, text, finish)
            assert [name for name, _ in calls] == ["get_weather"], (k, calls)
            if cut is _messages_cut:  # (Anthropic's input is an object: {} until whole)
                break
            args = calls[0][1]
            assert args.startswith("{"), args
            try:
                json.loads(args)
            except ValueError:
                break  # the arguments as far as written
        else:
            pytest.fail(f"no cut of the last 7 tokens left the arguments unfinished: {args}")
        text, calls, finish = cut(h, 3, stream)  # before the name
        assert (text, calls, finish) == ("", [], length)
