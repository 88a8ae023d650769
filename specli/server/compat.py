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

from specli.config import SAMPLING
from specli.server import formats as f
from specli.server.errors import APIError
from specli.server.routes import (
    AppState,
    Pool,
    _auth,
    chat_job,
    chat_tokens,
    collect,
    named,
    resumable,
    start,
)
from specli.server.schemas import (
    ChatRequest,
    FunctionCallItem,
    FunctionCallOutput,
    ImageBlock,
    InputMedia,
    InputText,
    MessageItem,
    MessagesRequest,
    ReasoningItem,
    Refusal,
    ResponsesRequest,
    ResponsesToolChoice,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from specli.server.slots import Done, Generation, Progress
from specli.server.tools import ChatPlan, reading
from specli.toolcall import Parsed, ToolCall

router = APIRouter(dependencies=[Depends(_auth)])


def _chat(fields: dict) -> ChatRequest:
    """The chat request a Messages or Responses request becomes; its errors are 400s that
    name the field of the chat form."""
    try:
        return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"{where}: {err['msg']}", param=where) from None


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, separators=(',', ':'))}\n\n"


def _toolu(call: ToolCall) -> str:
    """A call's id as Anthropic's clients show it (toolu_...; a family's own id, Mistral's
    nine characters, as the template needs it back)."""
    return "toolu_" + call.id.removeprefix("call_") if call.id.startswith("call_") else call.id


def _fc(call: ToolCall) -> str:
    """A function_call item's id (OpenAI's fc_...; its call_id is the call's own)."""
    return "fc_" + call.id.removeprefix("call_")


def _json_or_empty(call: ToolCall) -> str:
    """A call's arguments as Anthropic's stream sends them: JSON its clients parse (a call
    the token limit cut, whose arguments are no JSON yet, sends {} as its input is)."""
    try:
        json.loads(call.arguments)
    except ValueError:
        return "{}"
    return call.arguments


def _arguments(call: ToolCall) -> dict:
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# -- Anthropic's Messages ------------------------------------------------------------------

def _text_of(content, sep: str = "") -> str:
    """The text of a content string or of its text blocks (or parts)."""
    if isinstance(content, str):
        return content
    return sep.join(b.text for b in content or () if isinstance(b, TextBlock | InputText))


def anthropic_chat(raw: MessagesRequest) -> ChatRequest:
    """A Messages request as a chat request: system first, content blocks as text parts,
    tool_use blocks as the assistant's tool_calls, tool_result blocks as tool messages
    (after the turn's text), thinking blocks as its reasoning_content; a block of another
    type is passed over, as Anthropic's own extensions are."""
    messages: list[dict] = []
    if raw.system:
        # Claude Code's system prompt comes in several blocks: one paragraph each
        messages.append({"role": "system", "content": _text_of(raw.system, "\n\n")})
    for i, m in enumerate(raw.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        parts, calls, results, thinking = [], [], [], ""
        for j, b in enumerate(m.content):
            if isinstance(b, TextBlock):
                parts.append({"type": "text", "text": b.text})
            elif isinstance(b, ImageBlock):
                parts.append({"type": "image_url", "image_url": {"url": ""}})
            elif isinstance(b, ToolUseBlock):
                calls.append({"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": _json(b.input, f"messages[{i}].content[{j}]"
                                                       ".input")}})
            elif isinstance(b, ToolResultBlock):
                if any(isinstance(x, ImageBlock) for x in b.content or ()
                       if not isinstance(b.content, str)):
                    raise APIError(400, "image input is not supported: specli serves "
                                   "text-only models (an image in a tool_result)",
                                   param=f"messages[{i}].content[{j}]")
                results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": _text_of(b.content)})
            elif isinstance(b, ThinkingBlock):
                thinking += b.thinking
        if parts or calls or thinking or not results:
            msg: dict = {"role": m.role, "content": parts}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = thinking
            messages.append(msg)
        messages += results
    tools = [{"type": "function", "function": {
        "name": t.name, "description": t.description or "",
        "parameters": t.input_schema or {"type": "object"}}} for t in raw.tools or ()]
    choice, parallel = None, None
    if raw.tool_choice is not None:
        c = raw.tool_choice
        parallel = False if c.disable_parallel_tool_use else None
        if c.type == "tool" and not c.name:
            raise APIError(400, "tool_choice.name is required for a tool_choice of type tool",
                           param="tool_choice.name")
        choice = {"type": "function", "function": {"name": c.name}} if c.type == "tool" \
            else {"auto": "auto", "any": "required", "none": "none"}[c.type]
    thinking = raw.thinking
    kwargs = {"enable_thinking": thinking.type == "enabled"} \
        if thinking is not None and thinking.type in ("enabled", "disabled") else None
    return _chat({"messages": messages, "tools": tools or None, "tool_choice": choice,
                  "parallel_tool_calls": parallel,
                  "max_tokens": 4096 if raw.max_tokens is None else raw.max_tokens,
                  "stop": raw.stop_sequences, "stream": raw.stream,
                  "chat_template_kwargs": kwargs, **_knobs(raw)})


def _knobs(raw: MessagesRequest | ResponsesRequest) -> dict:
    """The request's sampling parameters (config.SAMPLING's, by their request names), as
    the chat request takes them: one mapping for every API."""
    return {k.name: getattr(raw, k.name) for k in SAMPLING}


def _json(value, param: str) -> str:
    """A tool_use block's input as the JSON text of a call's arguments."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):
        raise APIError(400, f"{param} nests too deeply to be read", param=param) from None


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
async def messages(raw: MessagesRequest, request: Request, st: AppState, pool: Pool
                   ) -> Response:
    if raw.max_tokens is None:  # Anthropic's API requires it (count_tokens does not)
        raise APIError(400, "max_tokens: Field required: the Messages API takes the most "
                       "tokens to generate", param="max_tokens")
    body = _within(st, anthropic_chat(raw))
    cp, ids, job = await chat_job(st, body)
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "model": st.config.model_id}
    conv_id = named(request)
    gen = await start(pool, job)
    if body.stream:
        return f.sse(_anthropic_events(gen, cp, head, len(ids)), gen, False,
                     lambda kind, msg, _: _event("error", {"error": {  # Anthropic's name
                         "type": "api_error" if kind == "server_error" else kind,
                         "message": msg}}), resumable(request, conv_id))
    d = (await collect(gen, request))[0]
    p = cp.read(d.text, d.finish_reason == "length")
    content: list[dict] = []
    if p.reasoning:
        content.append({"type": "thinking", "thinking": p.reasoning, "signature": ""})
    if p.content:
        content.append({"type": "text", "text": p.content})
    content += [{"type": "tool_use", "id": _toolu(c), "name": c.name, "input": _arguments(c)}
                for c in p.calls]
    reason, word = _stop(d, bool(p.calls))
    return JSONResponse({**head, "content": content, "stop_reason": reason,
                         "stop_sequence": word, "usage": _usage(d.stats)})


async def _anthropic_events(gen: Generation, cp: ChatPlan, head: dict,
                            n_prompt: int) -> AsyncIterator[str]:
    yield _event("message_start", {"message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
    index, open_kind = -1, None

    def close() -> str:
        out = ""
        if open_kind == "thinking":
            out += _event("content_block_delta", {"index": index, "delta": {
                "type": "signature_delta", "signature": ""}})
        return out + _event("content_block_stop", {"index": index})

    async for r in reading(gen.events(), cp):
        if isinstance(r, Progress):
            continue
        ev = r.delta
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
            index, open_kind = index + 1, None
            yield _event("content_block_start", {"index": index, "content_block": {
                "type": "tool_use", "id": _toolu(c), "name": c.name, "input": {}}})
            yield _event("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": _json_or_empty(c)}})
            yield _event("content_block_stop", {"index": index})
        if r.done is not None:
            if open_kind is not None:
                yield close()
            reason, word = _stop(r.done, r.called)
            yield _event("message_delta", {"delta": {"stop_reason": reason,
                                                     "stop_sequence": word},
                                           "usage": {"output_tokens": r.done.stats.n_predict}})
            yield _event("message_stop", {})
            return


@router.post("/v1/messages/count_tokens")
async def count_tokens(raw: MessagesRequest, st: AppState, pool: Pool) -> dict:
    """The tokens of the prompt a Messages request would be given."""
    return {"input_tokens": await chat_tokens(st, anthropic_chat(raw))}


# -- OpenAI's Responses --------------------------------------------------------------------

def responses_chat(raw: ResponsesRequest) -> ChatRequest:
    """A Responses request as a chat request: instructions first, input items as messages
    (function_call items as the assistant's tool_calls, function_call_output as tool
    messages, reasoning as reasoning_content), flat function tools as chat tools."""
    if raw.previous_response_id:
        raise APIError(400, "previous_response_id is not supported: specli stores no "
                       "responses; send the whole conversation in input",
                       param="previous_response_id")
    messages: list[dict] = []
    if raw.instructions:
        messages.append({"role": "system", "content": raw.instructions})
    items = [MessageItem(role="user", content=raw.input)] if isinstance(raw.input, str) \
        else raw.input
    reasoning: dict[int, tuple[dict, list[str]]] = {}  # an assistant message's, in pieces
    for i, it in enumerate(items):
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if isinstance(it, MessageItem):
            content = it.content if isinstance(it.content, str) else \
                _parts(it.content, f"input[{i}].content")
            messages.append({"role": it.role, "content": content or ""})
        elif isinstance(it, FunctionCallItem):
            call = {"id": it.call_id, "type": "function", "function": {
                "name": it.name, "arguments": it.arguments}}
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(it, FunctionCallOutput):
            out = it.output
            messages.append({"role": "tool", "tool_call_id": it.call_id,
                             "content": out if isinstance(out, str) else "".join(
                                 p["text"] for p in _parts(out, f"input[{i}].output",
                                                           media=True))})
        elif isinstance(it, ReasoningItem):
            text = "".join(p.text for p in it.content or ())
            if text:
                if last is None:
                    messages.append(last := {"role": "assistant", "content": ""})
                reasoning.setdefault(id(last), (last, []))[1].append(text)
        else:
            raise APIError(400, f"input[{i}]: an item of a type specli does not read "
                           f"({it.type!r})", param=f"input[{i}].type")
    for m, texts in reasoning.values():  # joined once (16,000 items: quadratic, added up)
        m["reasoning_content"] = "".join(texts)
    tools = []
    for i, t in enumerate(raw.tools or ()):
        if t.type != "function":
            continue  # hosted tools (web search, files...): none here
        if not t.name:
            raise APIError(400, f"tools[{i}].name is required for a function tool",
                           param=f"tools[{i}].name")
        tools.append({"type": "function", "function": {
            "name": t.name, "description": t.description or "",
            "parameters": t.parameters or {"type": "object"}}})
    choice = raw.tool_choice
    if isinstance(choice, ResponsesToolChoice):
        if choice.type != "function" or not choice.name:
            raise APIError(400, "tool_choice: auto, none, required or "
                           '{"type": "function", "name": ...}', param="tool_choice")
        choice = {"type": "function", "function": {"name": choice.name}}
    fmt = raw.text.format if raw.text is not None else None
    response_format = None if fmt is None or fmt.type == "text" else \
        {"type": "json_object"} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name or "answer",
                                                   "schema": fmt.schema_ or {}}}
    return _chat({"messages": messages, "tools": tools or None, "tool_choice": choice,
                  "parallel_tool_calls": raw.parallel_tool_calls,
                  "max_tokens": raw.max_output_tokens,
                  "stream": raw.stream, "response_format": response_format, **_knobs(raw),
                  "reasoning_effort": raw.reasoning.effort if raw.reasoning else None,
                  "timings_per_token": raw.timings_per_token,
                  "return_progress": raw.return_progress})


def _parts(parts: list, param: str, media: bool = False) -> list[dict]:
    """Responses content parts as chat text parts; media is a 400 that says so (in a tool's
    output, passed over: Codex sends the images its tools viewed), a part of a type specli
    does not read is passed over."""
    out = []
    for j, p in enumerate(parts):
        if isinstance(p, InputText):
            out.append({"type": "text", "text": p.text})
        elif isinstance(p, Refusal):
            out.append({"type": "text", "text": p.refusal})
        elif isinstance(p, InputMedia) and not media:
            raise APIError(400, f"{p.type[6:]} input is not supported: specli serves "
                           "text-only models", param=f"{param}[{j}]")
    return out


def _resp_usage(s) -> dict:
    return {"input_tokens": s.n_prompt, "input_tokens_details": {"cached_tokens": f.cached(s)},
            "output_tokens": s.n_predict, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": s.n_prompt + s.n_predict}


def _items(p: Parsed, msg_id: str, rs_id: str, cut: bool = False) -> list[dict]:
    """A whole answer's output items; cut by the token limit, the last is incomplete."""
    out: list[dict] = []
    if p.reasoning:
        out.append({"id": rs_id, "type": "reasoning", "summary": [], "status": "completed",
                    "content": [{"type": "reasoning_text", "text": p.reasoning}]})
    if p.content or not p.calls:
        out.append({"id": msg_id, "type": "message", "role": "assistant",
                    "status": "completed", "content": [_text_part(p.content)]})
    out += [_call_item(c, "completed") for c in p.calls]
    if cut:
        out[-1]["status"] = "incomplete"
    return out


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(c: ToolCall, status: str) -> dict:
    return {"id": _fc(c), "type": "function_call", "status": status,
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
async def responses(raw: ResponsesRequest, request: Request, st: AppState, pool: Pool
                    ) -> Response:
    body = _within(st, responses_chat(raw))
    cp, _, job = await chat_job(st, body)
    head = {"id": f"resp_{uuid.uuid4().hex}", "object": "response",
            "created_at": int(time.time()), "model": st.config.model_id, "error": None,
            "instructions": raw.instructions, "max_output_tokens": body.max_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": "auto" if raw.tool_choice is None else raw.tool_choice
            if isinstance(raw.tool_choice, str) else raw.tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in raw.tools or ()],
            "metadata": raw.metadata or {}, "text": {"format": {"type": "text"}}}
    ids = (f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}")
    conv_id = named(request)
    gen = await start(pool, job)
    if body.stream:
        return f.sse(_responses_events(gen, cp, head, *ids), gen, False,
                     lambda kind, msg, code: _event("error", {"code": code or kind,
                                                              "message": msg, "param": None}),
                     resumable(request, conv_id))
    d = (await collect(gen, request))[0]
    cut = d.finish_reason == "length"
    return JSONResponse(_response(head, "incomplete" if cut else "completed",
                                  _items(cp.read(d.text, cut), *ids, cut), d))


async def _responses_events(gen: Generation, cp: ChatPlan, head: dict, msg_id: str,
                            rs_id: str) -> AsyncIterator[str]:
    seq = iter(range(1 << 62))

    def ev(name: str, **data) -> str:
        return _event(name, {"sequence_number": next(seq), **data})

    yield ev("response.created", response=_response(head, "in_progress", [], None))
    yield ev("response.in_progress", response=_response(head, "in_progress", [], None))
    output: list[dict] = []
    open_kind, text = None, ""  # the item being written: "reasoning" or "message"

    def close(status: str = "completed") -> list[str]:
        at, item = len(output) - 1, output[-1]
        if open_kind == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            item["status"] = status
            return [ev("response.reasoning_text.done", item_id=rs_id, output_index=at,
                       content_index=0, text=text),
                    ev("response.output_item.done", output_index=at, item=item)]
        part = _text_part(text)
        item["content"], item["status"] = [part], status
        return [ev("response.output_text.done", item_id=msg_id, output_index=at,
                   content_index=0, text=text, logprobs=[]),
                ev("response.content_part.done", item_id=msg_id, output_index=at,
                   content_index=0, part=part),
                ev("response.output_item.done", output_index=at, item=item)]

    async for r in reading(gen.events(), cp):
        if isinstance(r, Progress):  # llama-server's: on response.in_progress
            yield ev("response.in_progress", response=_response(head, "in_progress", [], None),
                     prompt_progress=r.progress)
            continue
        d = r.delta
        cut = r.done is not None and r.done.finish_reason == "length"  # its last item is
        extra = {"timings": f.timings(r.piece.stats)} if r.piece is not None and \
            r.piece.stats is not None else {}
        for kind, delta in (("reasoning", d.reasoning), ("message", d.content)):
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
        for k, c in enumerate(d.calls):
            if open_kind is not None:
                for line in close():
                    yield line
                open_kind = None
            output.append(_call_item(c, "in_progress") | {"arguments": ""})
            at = len(output) - 1
            yield ev("response.output_item.added", output_index=at, item=output[at])
            yield ev("response.function_call_arguments.delta", item_id=_fc(c),
                     output_index=at, delta=c.arguments)
            yield ev("response.function_call_arguments.done", item_id=_fc(c),
                     output_index=at, arguments=c.arguments)
            output[at] = _call_item(c, "incomplete" if cut and k == len(d.calls) - 1
                                    else "completed")
            yield ev("response.output_item.done", output_index=at, item=output[at])
        if r.done is not None:
            if open_kind is not None:
                for line in close("incomplete" if cut else "completed"):
                    yield line
            elif not output:  # an empty answer is still a message
                item = {"id": msg_id, "type": "message", "role": "assistant",
                        "status": "incomplete" if cut else "completed",
                        "content": [_text_part("")]}
                output.append(item)
                yield ev("response.output_item.added", output_index=0, item=item)
                yield ev("response.output_item.done", output_index=0, item=item)
            # response.completed even when cut short (its status says incomplete), as
            # llama-server: clients' stream helpers wait for that event alone
            status = "incomplete" if r.done.finish_reason == "length" else "completed"
            yield ev("response.completed", response=_response(head, status, output, r.done),
                     timings=f.timings(r.done.stats))
            return


@router.post("/v1/responses/input_tokens")
@router.post("/responses/input_tokens", include_in_schema=False)
async def responses_input_tokens(raw: ResponsesRequest, st: AppState, pool: Pool) -> dict:
    """The tokens of the prompt a Responses request would be given."""
    return {"object": "response.input_tokens",
            "input_tokens": await chat_tokens(st, responses_chat(raw))}
