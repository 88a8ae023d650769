"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) and OpenAI's Responses
API (/v1/responses, /v1/responses/input_tokens) over the chat machinery: each request becomes
a chat request (messages, tools, tool_choice, sampling), runs as one, and its answer (content,
reasoning, tool calls: server/tools.py) is written in that API's shape, whole or as its stream
of named events. llama-server maps them the same way (server-chat.cpp, server-task.cpp)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from specli.server import formats as f
from specli.server.errors import APIError
from specli.server.routes import AppState, Pool, _auth, chat_job, chat_tokens, collect, start
from specli.server.schemas import ChatRequest
from specli.server.slots import Done, Generation, Piece, Progress
from specli.server.tools import ChatPlan
from specli.toolcall import Parsed, Splitter, ToolCall

router = APIRouter(dependencies=[Depends(_auth)])


async def _body(request: Request) -> dict:
    try:
        raw = await request.json()
    except ValueError:
        raise APIError(400, "the body is not JSON") from None
    if not isinstance(raw, dict):
        raise APIError(400, "the body must be a JSON object")
    return raw


def _chat(fields: dict) -> ChatRequest:
    """The chat request a Messages or Responses request becomes; its errors are 400s that
    name the field of the chat form."""
    try:
        return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"{where}: {err['msg']}", param=where) from None


async def _pieces(gen: Generation, cp: ChatPlan
                  ) -> AsyncIterator[tuple[Parsed, dict | None] | Done | Progress]:
    """The generation as the reading's deltas (reasoning, content, calls) with the timings
    a piece carries (timings_per_token), its prompt progress (return_progress), then its
    Done."""
    s = Splitter(cp.fam, cp.tools, cp.forced_open, cp.reasoning_format, cp.parse_calls)
    async for ev in gen.events():
        if isinstance(ev, Piece):
            yield s.feed(ev.text), f.timings(ev.stats) if ev.stats is not None else None
        elif isinstance(ev, Done):
            yield s.finish(), None
            yield ev
        else:
            yield ev


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, separators=(',', ':'))}\n\n"


def _arguments(call: ToolCall) -> dict:
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# -- Anthropic's Messages ------------------------------------------------------------------

def _text_of(content, sep: str = "") -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return sep.join(str(b.get("text", "")) for b in content
                        if isinstance(b, dict) and b.get("type") == "text")
    return ""


def anthropic_chat(raw: dict) -> ChatRequest:
    """A Messages request as a chat request: system first, content blocks as text parts,
    tool_use blocks as the assistant's tool_calls, tool_result blocks as tool messages
    (after the turn's text), thinking blocks as its reasoning_content."""
    if not isinstance(raw.get("messages"), list):
        raise APIError(400, "messages: a list of messages is required", param="messages")
    messages: list[dict] = []
    system = raw.get("system")
    if system:
        # Claude Code's system prompt comes in several blocks: one paragraph each
        messages.append({"role": "system", "content": _text_of(system, "\n\n")})
    for i, m in enumerate(raw["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise APIError(400, f"messages[{i}]: each message has a role, user or assistant",
                           param=f"messages[{i}]")
        content = m.get("content")
        if not isinstance(content, list):
            messages.append({"role": m["role"], "content": content if isinstance(
                content, str) else ""})
            continue
        parts, calls, results, thinking = [], [], [], ""
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(b.get("text", ""))})
            elif kind == "image":
                parts.append({"type": "image_url", "image_url": {"url": ""}})
            elif kind == "tool_use":
                calls.append({"id": str(b.get("id", "")), "type": "function", "function": {
                    "name": str(b.get("name", "")),
                    "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result":
                inner = b.get("content")
                if isinstance(inner, list) and any(isinstance(x, dict) and x.get("type") ==
                                                   "image" for x in inner):
                    raise APIError(400, "image input is not supported: specli serves "
                                   "text-only models (an image in a tool_result)",
                                   param=f"messages[{i}].content[{j}]")
                results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                                "content": _text_of(inner)})
            elif kind == "thinking":
                thinking += str(b.get("thinking", ""))
        if parts or calls or thinking or not results:
            msg: dict = {"role": m["role"], "content": parts}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = thinking
            messages.append(msg)
        messages += results
    tools = [{"type": "function", "function": {
        "name": t.get("name"), "description": t.get("description", ""),
        "parameters": t.get("input_schema") or {"type": "object"}}}
        for t in raw.get("tools") or () if isinstance(t, dict)]
    choice, parallel = raw.get("tool_choice"), None
    if isinstance(choice, dict):
        parallel = False if choice.get("disable_parallel_tool_use") else None
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.get("type"), {"type": "function", "function": {"name": choice.get("name")}}
            if choice.get("type") == "tool" else choice.get("type"))
    thinking = raw.get("thinking")
    kwargs = {"enable_thinking": thinking.get("type") == "enabled"} \
        if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled") \
        else None
    return _chat({"messages": messages, "tools": tools or None, "tool_choice": choice,
                  "parallel_tool_calls": parallel,
                  "max_tokens": raw.get("max_tokens", 4096), "stop": raw.get("stop_sequences"),
                  "temperature": raw.get("temperature"), "top_p": raw.get("top_p"),
                  "top_k": raw.get("top_k"), "stream": raw.get("stream"),
                  "chat_template_kwargs": kwargs})


def _usage(s) -> dict:
    cached = f.cached(s)
    return {"input_tokens": s.n_prompt - cached, "output_tokens": s.n_predict,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stop(d: Done, calls: bool) -> tuple[str, str | None]:
    if d.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if d.stopping_word:
        return "stop_sequence", d.stopping_word
    return "end_turn", None


def _within(st, body: ChatRequest) -> ChatRequest:
    """Claude-Code-style clients ask for max_tokens of 32,000 and more whatever the model:
    beyond the context, the answer runs until the end of generation or a full context
    (stop_reason max_tokens), as llama-server runs it, rather than a 400."""
    if body.max_tokens is not None and body.max_tokens > st.engine.target.n_ctx:
        return body.model_copy(update={"max_tokens": None})
    return body


@router.post("/v1/messages")
async def messages(request: Request, st: AppState, pool: Pool) -> Response:
    body = _within(st, anthropic_chat(await _body(request)))
    cp, ids, job = await chat_job(st, body)
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "model": st.config.model_id}
    gen = await start(pool, job)
    if body.stream:
        return f.sse(_anthropic_events(gen, cp, head, len(ids)), gen, False,
                     lambda kind, msg, _: _event("error", {"error": {  # Anthropic's name
                         "type": "api_error" if kind == "server_error" else kind,
                         "message": msg}}))
    d = (await collect(gen, request))[0]
    p = cp.read(d.text)
    content: list[dict] = []
    if p.reasoning:
        content.append({"type": "thinking", "thinking": p.reasoning, "signature": ""})
    if p.content:
        content.append({"type": "text", "text": p.content})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _arguments(c)}
                for c in p.calls]
    reason, word = _stop(d, bool(p.calls))
    return JSONResponse({**head, "content": content, "stop_reason": reason,
                         "stop_sequence": word, "usage": _usage(d.stats)})


async def _anthropic_events(gen: Generation, cp: ChatPlan, head: dict,
                            n_prompt: int) -> AsyncIterator[str]:
    yield _event("message_start", {"message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
    index, open_kind, calls = -1, None, False

    def close() -> str:
        out = ""
        if open_kind == "thinking":
            out += _event("content_block_delta", {"index": index, "delta": {
                "type": "signature_delta", "signature": ""}})
        return out + _event("content_block_stop", {"index": index})

    async for item in _pieces(gen, cp):
        if isinstance(item, Progress):
            continue
        ev = item if isinstance(item, Done) else item[0]
        if isinstance(ev, Done):
            if open_kind is not None:
                yield close()
            reason, word = _stop(ev, calls)
            yield _event("message_delta", {"delta": {"stop_reason": reason,
                                                     "stop_sequence": word},
                                           "usage": {"output_tokens": ev.stats.n_predict}})
            yield _event("message_stop", {})
            return
        for kind, text in (("thinking", ev.reasoning), ("text", ev.content)):
            if not text:
                continue
            if open_kind != kind:
                if open_kind is not None:
                    yield close()
                index, open_kind = index + 1, kind
                yield _event("content_block_start", {"index": index, "content_block": {
                    "type": kind, kind: ""}})
            yield _event("content_block_delta", {"index": index, "delta": {
                "type": f"{kind}_delta", kind: text}})
        for c in ev.calls:
            if open_kind is not None:
                yield close()
            index, open_kind, calls = index + 1, None, True
            yield _event("content_block_start", {"index": index, "content_block": {
                "type": "tool_use", "id": c.id, "name": c.name, "input": {}}})
            yield _event("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": c.arguments}})
            yield _event("content_block_stop", {"index": index})


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, st: AppState, pool: Pool) -> dict:
    """The tokens of the prompt a Messages request would be given."""
    return {"input_tokens": await chat_tokens(st, anthropic_chat(await _body(request)))}


# -- OpenAI's Responses --------------------------------------------------------------------

def responses_chat(raw: dict) -> ChatRequest:
    """A Responses request as a chat request: instructions first, input items as messages
    (function_call items as the assistant's tool_calls, function_call_output as tool
    messages, reasoning as reasoning_content), flat function tools as chat tools."""
    if raw.get("previous_response_id"):
        raise APIError(400, "previous_response_id is not supported: specli stores no "
                       "responses; send the whole conversation in input",
                       param="previous_response_id")
    if "input" not in raw:
        raise APIError(400, "input is required", param="input")
    messages: list[dict] = []
    if raw.get("instructions"):
        messages.append({"role": "system", "content": str(raw["instructions"])})
    items = raw["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise APIError(400, "input is text or a list of items", param="input")
    for i, it in enumerate(items):
        kind = it.get("type", "message") if isinstance(it, dict) else None
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message" and it.get("role") in ("user", "system", "developer", "assistant"):
            content = it.get("content")
            if isinstance(content, list):
                parts = []
                for j, p in enumerate(content):
                    t = p.get("type") if isinstance(p, dict) else None
                    if t in ("input_text", "output_text", "text"):
                        parts.append({"type": "text", "text": str(p.get("text", ""))})
                    elif t in ("input_image", "input_file", "input_audio"):
                        raise APIError(400, f"{t[6:]} input is not supported: specli serves "
                                       "text-only models", param=f"input[{i}].content[{j}]")
                    elif t == "refusal":
                        parts.append({"type": "text", "text": str(p.get("refusal", ""))})
                content = parts
            messages.append({"role": it["role"], "content": content or ""})
        elif kind == "function_call":
            call = {"id": str(it.get("call_id", "")), "type": "function", "function": {
                "name": str(it.get("name", "")), "arguments": str(it.get("arguments", ""))}}
            if last is not None and not any(m["role"] == "tool" for m in messages[-1:]):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output")
            messages.append({"role": "tool", "tool_call_id": str(it.get("call_id", "")),
                             "content": out if isinstance(out, str) else _text_of(
                                 [{"type": "text", "text": p.get("text", "")}
                                  for p in out or () if isinstance(p, dict)])})
        elif kind == "reasoning":
            text = "".join(str(p.get("text", "")) for p in it.get("content") or ()
                           if isinstance(p, dict))
            if text:
                if last is None:
                    messages.append(last := {"role": "assistant", "content": ""})
                last["reasoning_content"] = last.get("reasoning_content", "") + text
        else:
            raise APIError(400, f"input[{i}]: an item of a type specli does not read "
                           f"({kind!r})", param=f"input[{i}]")
    tools = [{"type": "function", "function": {
        "name": t.get("name"), "description": t.get("description", ""),
        "parameters": t.get("parameters") or {"type": "object"}}}
        for t in raw.get("tools") or () if isinstance(t, dict) and t.get("type") == "function"]
    choice = raw.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    fmt = ((raw.get("text") or {}).get("format") or {}) if isinstance(raw.get("text"),
                                                                      dict) else {}
    response_format = {"type": "json_schema", "json_schema": {
        "name": fmt.get("name", "answer"), "schema": fmt.get("schema") or {}}} \
        if fmt.get("type") == "json_schema" else {"type": "json_object"} \
        if fmt.get("type") == "json_object" else None
    effort = (raw.get("reasoning") or {}).get("effort") if isinstance(
        raw.get("reasoning"), dict) else None
    return _chat({"messages": messages, "tools": tools or None, "tool_choice": choice,
                  "parallel_tool_calls": raw.get("parallel_tool_calls"),
                  "max_tokens": raw.get("max_output_tokens"),
                  "temperature": raw.get("temperature"), "top_p": raw.get("top_p"),
                  "stream": raw.get("stream"), "response_format": response_format,
                  "reasoning_effort": effort,
                  # llama-server's telemetry in the stream
                  "timings_per_token": raw.get("timings_per_token"),
                  "return_progress": raw.get("return_progress")})


def _resp_usage(s) -> dict:
    return {"input_tokens": s.n_prompt, "input_tokens_details": {"cached_tokens": f.cached(s)},
            "output_tokens": s.n_predict, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": s.n_prompt + s.n_predict}


def _items(p: Parsed, msg_id: str, rs_id: str) -> list[dict]:
    out: list[dict] = []
    if p.reasoning:
        out.append({"id": rs_id, "type": "reasoning", "summary": [], "status": "completed",
                    "content": [{"type": "reasoning_text", "text": p.reasoning}]})
    if p.content or not p.calls:
        out.append({"id": msg_id, "type": "message", "role": "assistant",
                    "status": "completed", "content": [_text_part(p.content)]})
    out += [_call_item(c, "completed") for c in p.calls]
    return out


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(c: ToolCall, status: str) -> dict:
    return {"id": f"fc_{c.id}", "type": "function_call", "status": status,
            "call_id": c.id, "name": c.name, "arguments": c.arguments}


def _response(head: dict, status: str, output: list[dict], d: Done | None) -> dict:
    out = {**head, "status": status, "output": output,
           "usage": _resp_usage(d.stats) if d is not None else None,
           "incomplete_details": {"reason": "max_output_tokens"}
           if d is not None and d.finish_reason == "length" else None}
    if d is not None:
        out["output_text"] = "".join(part["text"] for it in output
                                     if it["type"] == "message" for part in it["content"])
    return out


@router.post("/v1/responses")
@router.post("/responses", include_in_schema=False)
async def responses(request: Request, st: AppState, pool: Pool) -> Response:
    raw = await _body(request)
    body = _within(st, responses_chat(raw))
    cp, _, job = await chat_job(st, body)
    head = {"id": f"resp_{uuid.uuid4().hex}", "object": "response",
            "created_at": int(time.time()), "model": st.config.model_id, "error": None,
            "instructions": raw.get("instructions"), "max_output_tokens": body.max_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": raw.get("tool_choice", "auto"), "tools": raw.get("tools") or [],
            "metadata": raw.get("metadata") or {}, "text": {"format": {"type": "text"}}}
    ids = (f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}")
    gen = await start(pool, job)
    if body.stream:
        return f.sse(_responses_events(gen, cp, head, *ids), gen, False,
                     lambda kind, msg, code: _event("error", {"code": code or kind,
                                                              "message": msg, "param": None}))
    d = (await collect(gen, request))[0]
    status = "incomplete" if d.finish_reason == "length" else "completed"
    return JSONResponse(_response(head, status, _items(cp.read(d.text), *ids), d))


async def _responses_events(gen: Generation, cp: ChatPlan, head: dict, msg_id: str,
                            rs_id: str) -> AsyncIterator[str]:
    seq = iter(range(1 << 62))

    def ev(name: str, **data) -> str:
        return _event(name, {"sequence_number": next(seq), **data})

    yield ev("response.created", response=_response(head, "in_progress", [], None))
    yield ev("response.in_progress", response=_response(head, "in_progress", [], None))
    output: list[dict] = []
    open_kind, text = None, ""  # the item being written: "reasoning" or "message"

    def close() -> list[str]:
        at, item = len(output) - 1, output[-1]
        if open_kind == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            item["status"] = "completed"
            return [ev("response.reasoning_text.done", item_id=rs_id, output_index=at,
                       content_index=0, text=text),
                    ev("response.output_item.done", output_index=at, item=item)]
        part = _text_part(text)
        item["content"], item["status"] = [part], "completed"
        return [ev("response.output_text.done", item_id=msg_id, output_index=at,
                   content_index=0, text=text, logprobs=[]),
                ev("response.content_part.done", item_id=msg_id, output_index=at,
                   content_index=0, part=part),
                ev("response.output_item.done", output_index=at, item=item)]

    async for item in _pieces(gen, cp):
        if isinstance(item, Progress):  # llama-server's: on response.in_progress
            yield ev("response.in_progress", response=_response(head, "in_progress", [], None),
                     prompt_progress=item.progress)
            continue
        piece, timing = (item, None) if isinstance(item, Done) else item
        extra = {"timings": timing} if timing is not None else {}
        if isinstance(piece, Done):
            if open_kind is not None:
                for line in close():
                    yield line
            elif not output:  # an empty answer is still a message
                item = {"id": msg_id, "type": "message", "role": "assistant",
                        "status": "completed", "content": [_text_part("")]}
                output.append(item)
                yield ev("response.output_item.added", output_index=0, item=item)
                yield ev("response.output_item.done", output_index=0, item=item)
            # response.completed even when cut short (its status says incomplete), as
            # llama-server: clients' stream helpers wait for that event alone
            status = "incomplete" if piece.finish_reason == "length" else "completed"
            yield ev("response.completed", response=_response(head, status, output, piece),
                     timings=f.timings(piece.stats))
            return
        for kind, delta in (("reasoning", piece.reasoning), ("message", piece.content)):
            if not delta:
                continue
            if open_kind != kind:
                if open_kind is not None:
                    for line in close():
                        yield line
                open_kind, text = kind, ""
                item = {"id": rs_id, "type": "reasoning", "summary": [], "content": [],
                        "status": "in_progress"} if kind == "reasoning" else \
                    {"id": msg_id, "type": "message", "role": "assistant",
                     "status": "in_progress", "content": []}
                output.append(item)
                yield ev("response.output_item.added", output_index=len(output) - 1,
                         item=item)
                if kind == "message":
                    yield ev("response.content_part.added", item_id=msg_id,
                             output_index=len(output) - 1, content_index=0,
                             part=_text_part(""))
            text += delta
            yield ev("response.reasoning_text.delta" if kind == "reasoning" else
                     "response.output_text.delta", item_id=rs_id if kind == "reasoning"
                     else msg_id, output_index=len(output) - 1, content_index=0,
                     delta=delta, **({} if kind == "reasoning" else {"logprobs": []}),
                     **extra)
        for c in piece.calls:
            if open_kind is not None:
                for line in close():
                    yield line
                open_kind = None
            output.append(_call_item(c, "in_progress") | {"arguments": ""})
            at = len(output) - 1
            yield ev("response.output_item.added", output_index=at, item=output[at])
            yield ev("response.function_call_arguments.delta", item_id=f"fc_{c.id}",
                     output_index=at, delta=c.arguments)
            yield ev("response.function_call_arguments.done", item_id=f"fc_{c.id}",
                     output_index=at, arguments=c.arguments)
            output[at] = _call_item(c, "completed")
            yield ev("response.output_item.done", output_index=at, item=output[at])


@router.post("/v1/responses/input_tokens")
@router.post("/responses/input_tokens", include_in_schema=False)
async def responses_input_tokens(request: Request, st: AppState, pool: Pool) -> dict:
    """The tokens of the prompt a Responses request would be given."""
    return {"object": "response.input_tokens",
            "input_tokens": await chat_tokens(st, responses_chat(await _body(request)))}
