"""The routes, one APIRouter per family: health (public), information (/v1/models, /props,
/metrics), OpenAI generation (/v1/chat/completions, /v1/completions) and llama-server's
/completion. The app's State arrives by dependency."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specli import __version__, child
from specli.batching import SharedContext
from specli.config import (
    DRAFTING,
)
from specli.errors import ContextOverflowError, UsageError
from specli.server import formats as f
from specli.server import jobs
from specli.server.errors import APIError, envelope, overflow, refuse, unavailable
from specli.server.metrics import CONTENT_TYPE
from specli.server.schemas import (
    MEDIA,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    JsonPrompt,
    LlamaCompletionRequest,
    Sampling,
    Speculative,
    TokenizeRequest,
    Transforms,
)
from specli.server.slots import Busy, Done, Generation, Job, SlotPool
from specli.server.state import State
from specli.server.streams import HEADER, LOOKUP_MAX, Session
from specli.server.tools import ChatPlan, reading


def _state(request: Request) -> State:
    return request.app.state.specli


AppState = Annotated[State, Depends(_state)]
FINGERPRINT = f"b{__version__}-specli"  # OpenAI's system_fingerprint, as llama-server's "b..."


async def _ready(st: AppState) -> SlotPool:
    """The slots, or 503 while they load (or after loading failed)."""
    if st.pool is None or st.down:
        raise APIError(503, st.down or st.error or "Loading model", "unavailable_error",
                       code="unavailable")
    return st.pool


Pool = Annotated[SlotPool, Depends(_ready)]


async def _auth(request: Request, st: AppState) -> None:
    keys = st.config.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    token = header[7:].strip() if header.lower().startswith("bearer ") else \
        request.headers.get("x-api-key", "")
    if not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
        raise APIError(401, "Invalid API Key", "authentication_error",
                       code="invalid_api_key")


public = APIRouter()
info = APIRouter(dependencies=[Depends(_auth)])
openai = APIRouter(dependencies=[Depends(_auth)])
llama = APIRouter(dependencies=[Depends(_auth)])


# -- public ---------------------------------------------------------------------------------

@public.get("/health")
@public.get("/v1/health", include_in_schema=False)
async def health(st: AppState) -> JSONResponse:
    if st.pool is None or st.down:
        return envelope(503, st.down or st.error or "Loading model", "unavailable_error",
                        code=503)
    return JSONResponse({"status": "ok", "slots_idle": st.pool.idle,
                         "slots_processing": len(st.pool.slots) - st.pool.idle})


# llama-server's routes that specli does not serve, and what they are: a 501 that says so
# (README, "Not served")
NOT_SERVED = {
    ("GET", "/"): "the web UI", ("GET", "/index.html"): "the web UI",
    ("POST", "/infill"): "code infill",
    **{("POST", p): "embeddings" for p in ("/embedding", "/embeddings", "/v1/embeddings")},
    **{("POST", p): "reranking" for p in ("/rerank", "/reranking", "/v1/rerank",
                                          "/v1/reranking")},
    **{("POST", p): "audio transcription" for p in ("/audio/transcriptions",
                                                    "/v1/audio/transcriptions")},
    ("GET", "/lora-adapters"): "LoRA adapters", ("POST", "/lora-adapters"): "LoRA adapters",
    ("POST", "/slots/{id_slot}"): "saving, restoring and erasing slots",
    ("POST", "/props"): "changing the server's properties",
    ("POST", "/v1/chat/completions/control"): "controlling a running generation",
    ("GET", "/tools"): "the web UI's tools", ("POST", "/tools"): "the web UI's tools",
    ("GET", "/cors-proxy"): "the web UI's CORS proxy",
    ("POST", "/cors-proxy"): "the web UI's CORS proxy",
    ("POST", "/models/load"): "router mode", ("POST", "/models/unload"): "router mode",
}


def _not_served(what: str) -> Callable:
    async def answer(request: Request) -> JSONResponse:
        return envelope(501, f"specli does not implement {request.method} "
                        f"{request.url.path} ({what}): see the README's list of routes",
                        "not_supported_error", code="not_supported")
    return answer


for (_method, _path), _what in NOT_SERVED.items():
    public.add_api_route(_path, _not_served(_what), methods=[_method], include_in_schema=False)


# -- information ----------------------------------------------------------------------------

@info.get("/v1/models")
@info.get("/models", include_in_schema=False)
async def models(st: AppState) -> dict:
    c = st.config
    return {"object": "list", "data": [{
        "id": c.model_id, "aliases": list(c.aliases), "tags": list(c.tags), "object": "model",
        "created": st.created, "owned_by": "specli",
        "meta": {"path": c.target.path, "draft": c.draft.path if c.draft else None}}]}


@info.get("/props")
async def props(st: AppState, pool: Pool) -> dict:
    from specli.chat import FALLBACK_TEMPLATE

    e, c = st.engine, st.config
    template = e.target.chat_template()
    return {
        "model_alias": c.model_id, "model_path": c.target.path,
        "build_info": f"specli {__version__}",
        "total_slots": len(pool.slots),
        "slots": [{"id": s.id, "state": "processing" if s.busy else "idle",
                   "n_requests": s.n_requests} for s in pool.slots],
        "slots_idle": pool.idle, "requests_waiting": pool.waiting,
        "chat_template": template or FALLBACK_TEMPLATE,
        "chat_template_fallback": template is None,
        "chat_template_note": None if template else
        "the model file has no chat template: chat requests are rendered as ChatML",
        # llama-server's shape: the defaults under params, n_ctx per slot beside them
        "default_generation_settings": {
            "n_ctx": e.target.n_ctx,
            "params": f.settings(c.sampling, c.n_predict, (), c.plan.policy,
                                 types=c.plan.types)},
        "speculative": {
            "draft_model": c.draft.path if c.draft else None,
            "types": list(c.plan.types),
            "n_max": c.plan.policy.n_max, "n_min": c.plan.policy.n_min,
            "p_min": c.plan.policy.p_min, "auto": c.plan.policy.adaptive,
        },
    }


@info.get("/slots")
async def slots(st: AppState, pool: Pool) -> list:
    """Each slot's state (llama-server's GET /slots, on unless --no-slots)."""
    if not st.config.slots:
        raise APIError(501, "This server does not support slots endpoint. Start it with "
                       "`--slots`", "not_supported_error", code="not_supported")
    c = st.config

    def one(s) -> dict:
        out = {"id": s.id, "id_task": -1, "n_ctx": s.engine.target.n_ctx,
               "speculative": bool(c.plan.types), "is_processing": s.busy,
               "n_requests": s.n_requests, "n_cached": len(s.engine.target.tokens)}
        if s.job is not None:  # llama-server: the settings of the slot's last task, if any
            out["params"] = jobs.settings(st, s.job)
        return out

    return [one(s) for s in pool.slots]


@info.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> dict:
    return request.app.openapi()


@info.get("/metrics")
async def metrics(st: AppState) -> Response:
    if not st.config.metrics:  # llama-server's answer
        raise APIError(501, "This server does not support metrics endpoint. Start it with "
                       "`--metrics`", "not_supported_error", code="metrics_disabled")
    pool = st.pool

    def kv() -> tuple[int, int]:  # the target's cached tokens and room, over the slots
        slots = pool.slots if pool else []
        return (sum(len(s.engine.target.tokens) for s in slots),
                sum(s.engine.target.n_ctx for s in slots))

    target = next((c for c in pool.contexts if isinstance(c, SharedContext)), None) \
        if pool else None  # (the first: the target's)
    body = st.metrics.render(len(pool.slots) - pool.idle if pool else 0,
                             len(pool.slots) if pool else 0, pool.waiting if pool else 0, kv,
                             (target.n_decodes, target.n_seq_decodes) if target else (0, 0))
    return Response(body, media_type=CONTENT_TYPE,
                    headers={"Process-Start-Time-Unix": str(st.created)})


# -- resumable streams (streams.py) ---------------------------------------------------------

def named(request: Request) -> str:
    """The conversation a request names (X-Conversation-Id, '' if none), its earlier stream
    stopped: a new request replaces it from its start, as llama-server's does (its
    generation, client or none, no longer holds a slot the new one waits for)."""
    # (Starlette reads a header as latin-1: the client's UTF-8, as the query string has it)
    conv_id = request.headers.get(HEADER, "").encode("latin-1").decode("utf-8", "replace")
    if conv_id:
        _state(request).streams.stop(conv_id)
    return conv_id


def resumable(request: Request, conv_id: str) -> Session | None:
    """The stream session of a streamed answer to a request that named its conversation."""
    return _state(request).streams.open(conv_id) if conv_id else None


def _conv_id(request: Request) -> str:
    conv_id = request.query_params.get("conv_id", "")
    if not conv_id:
        raise APIError(400, "Missing conversation id: give conv_id in the query string",
                       param="conv_id")
    return conv_id


@llama.get("/v1/stream")
async def stream_replay(request: Request, st: AppState) -> Response:
    """A kept stream's bytes from offset `from` (0 by default), then live to its end."""
    s = st.streams.get(_conv_id(request))
    if s is None:
        raise APIError(404, "Stream not found or expired", "not_found_error")
    raw = request.query_params.get("from") or "0"
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise APIError(400, f"Invalid 'from' offset {raw[:40]!r}: a byte offset, 0 or more",
                       param="from")
    if int(raw) < s.dropped:
        raise APIError(400, f"Stream offset lost, please restart: the stream keeps its bytes "
                       f"from {s.dropped} on", param="from")
    return StreamingResponse(s.read(int(raw)), media_type="text/event-stream",
                             headers=f.SSE_HEADERS)


@llama.delete("/v1/stream", status_code=204)
async def stream_stop(request: Request, st: AppState) -> Response:
    """The user's Stop: the generation is cancelled and its stream forgotten (204 even if
    it was gone already)."""
    st.streams.stop(_conv_id(request))
    return Response(status_code=204)


@llama.post("/v1/streams/lookup")
async def streams_lookup(request: Request, st: AppState) -> Response:
    """The kept streams of the ids the caller names (only those: ids are not listed)."""
    try:
        body = json.loads(await request.body() or b"{}")
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"invalid body: {str(e)[:200]}") from None
    ids = body.get("conversation_ids") if isinstance(body, dict) else None
    ids = list(dict.fromkeys(i for i in ids if isinstance(i, str) and i)) \
        if isinstance(ids, list) else []
    if len(ids) > LOOKUP_MAX:
        raise APIError(400, f"{len(ids)} conversation_ids: at most {LOOKUP_MAX} a lookup",
                       param="conversation_ids")
    return JSONResponse(st.streams.lookup(ids))


# -- generation -----------------------------------------------------------------------------

async def _answer(request: Request, pool: Pool, job: Job, stream: bool,
                  events: Callable[[Generation], AsyncIterator[str]],
                  final: Callable[[list[Done], Generation], dict],
                  done_marker: bool = True) -> Response:
    """The one shape of a generation route: a slot, then a stream or the whole answer (a
    Done per choice)."""
    conv_id = named(request)
    gen = await start(pool, job)
    if stream:
        return f.sse(events(gen), gen, done_marker, session=resumable(request, conv_id))
    return JSONResponse(final(await collect(gen, request), gen))


@openai.post("/v1/chat/completions")
@openai.post("/chat/completions", include_in_schema=False)
async def chat(body: ChatRequest, request: Request, st: AppState, pool: Pool) -> Response:
    cp, ids, job = await chat_job(st, body)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": st.config.model_id, "system_fingerprint": FINGERPRINT}
    first = [{"index": i, "delta": {"role": "assistant", "content": None},
              "logprobs": None, "finish_reason": None} for i in range(job.n)]

    def final(dones: list[Done], gen: Generation) -> dict:
        choices = []
        for d in dones:
            message, reason = cp.message(d.text, f.finish(d))
            choices.append({"index": d.index, "message": message, "finish_reason": reason,
                            "logprobs": f.chat_logprobs(gen, d.probs)})
        out = {**head, "object": "chat.completion", "choices": choices,
               "usage": f.usage_of(dones), "timings": f.timings(dones[0].stats)}
        if body.verbose or st.config.verbose:  # llama-server's debugging aid (-v for all):
            # the answer as /completion gives it
            job.prompt_text = _text(st, ids)
            out["__verbose"] = f.llama_final(dones[0].text, dones[0], gen,
                                             st.config.model_id, jobs.settings(st, job))
        return out

    return await _answer(request, pool, job, bool(body.stream), lambda gen: f.openai_events(
        reading(gen.events(), cp), {**head, "object": "chat.completion.chunk"},
        f.chat_choice(cp.delta), _include_usage(body), first,
        lambda probs, _: f.chat_logprobs(gen, probs)), final)


async def chat_job(st: State, body: ChatRequest) -> tuple[ChatPlan, list[int], Job]:
    """A chat request's plan, prompt and job (shared with the Messages and Responses
    routes, server/compat.py)."""
    def prompt() -> tuple[ChatPlan, str, list[int], list[int] | None]:
        cp = _chat_plan(st, body)
        return cp, *st.engine.chat_prompt(*_conversation(body), cp.opts)

    # planning, rendering and tokenizing run off the event loop, within their bounds
    cp, text, ids, draft_ids = await _off_loop("messages", prompt, st=st)
    cp.prompted(text)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    # off the event loop: a grammar is checked, a logit bias text tokenized
    job = await st.jobs(
        jobs.job, st, body, ids, jobs.first(body.max_completion_tokens, body.max_tokens),
        "max_tokens", n_probs=(body.top_logprobs or 0) if body.logprobs else None,
        tools=cp.grammar)
    job.draft_prompt = draft_ids
    return cp, ids, job


def _chat_plan(st: State, body: ChatRequest) -> ChatPlan:
    """The request's tools and template variables, against the server's template."""
    from specli.prompt import jinja_source, template_caps
    from specli.server.tools import plan

    jinja, source = jinja_source(st.engine.target)
    if not jinja and (body.tools or body.chat_template_kwargs):
        raise APIError(400, "tools and chat_template_kwargs need the chat template rendered "
                       "as Jinja: start the server without --no-jinja", param="tools")
    c = st.config
    # the template is probed for tool calls only when the request brings tools
    cp = plan(body, source, jinja and (not body.tools or template_caps(source)[1]),
              c.reasoning, c.reasoning_format, c.template_kwargs)
    if cp.grammar is not None and cp.grammar[2] and any(
            len(st.engine.target.tokenize(t, add_special=False, parse_special=True)) != 1
            for t in cp.grammar[2]):
        cp.grammar = None  # a lazy grammar waits for an opener that is one token (samplers)
    return cp


@openai.post("/v1/chat/completions/input_tokens")
@openai.post("/chat/completions/input_tokens", include_in_schema=False)
async def chat_input_tokens(body: ChatRequest, st: AppState, pool: Pool) -> dict:
    """How many tokens the chat request's prompt is (llama-server's)."""
    return {"input_tokens": await chat_tokens(st, body)}


async def chat_tokens(st: State, body: ChatRequest) -> int:
    ids = await _off_loop("messages", lambda: st.engine.tokenize_messages(
        *_conversation(body), _chat_plan(st, body).opts), st=st)
    return len(ids)


@openai.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, st: AppState,
                      pool: Pool) -> Response:
    _refuse_completion(body)
    ids = await _prompt_ids(st, body.prompt[0] if isinstance(body.prompt, list) and
                            isinstance(body.prompt[0], str) else body.prompt)
    job = await st.jobs(jobs.job, st, body, ids, jobs.first(body.max_tokens, body.n_predict),
                        "max_tokens", n_probs=body.logprobs)
    job.cache_prompt = body.cache_prompt is not False
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": st.config.model_id, "object": "text_completion",
            "system_fingerprint": FINGERPRINT}

    def final(dones: list[Done], gen: Generation) -> dict:
        out = {**head, "choices": [{"index": d.index, "text": d.text,
                                    "logprobs": f.text_logprobs(gen, d.probs),
                                    "finish_reason": f.finish(d),
                                    **({"tokens": d.tokens} if body.return_tokens else {})}
                                   for d in dones],
               "usage": f.usage_of(dones), "timings": f.timings(dones[0].stats)}
        if st.config.verbose:  # -v: llama-server's __verbose, the answer as /completion's
            job.prompt_text = _text(st, job.prompt)
            out["__verbose"] = f.llama_final(dones[0].text, dones[0], gen,
                                             st.config.model_id, jobs.settings(st, job))
        return out

    return await _answer(request, pool, job, bool(body.stream), lambda gen: f.openai_events(
        reading(gen.events(), None), head, f.text_choice, _include_usage(body),
        logprobs=lambda probs, at: f.text_logprobs(gen, probs, at)), final)


@llama.post("/completion")
@llama.post("/completions", include_in_schema=False)  # llama-server's, not OpenAI's
async def completion(body: LlamaCompletionRequest, request: Request, st: AppState,
                     pool: Pool) -> Response:
    prompts = _prompts(body.prompt)
    if len(prompts) == 1:
        return await _completion(body, prompts[0], request, st, pool)
    if body.stream:
        raise APIError(400, "a batch of prompts cannot be streamed: send one prompt per "
                       "streamed request", param="prompt")
    answers = []
    for i, prompt in enumerate(prompts):  # one after another, each on the best idle slot
        r = await _completion(body, prompt, request, st, pool)
        answers.append({**json.loads(r.body), "index": i})
    return JSONResponse(answers)


def _prompts(prompt) -> list[str | list[int | str]]:
    """llama-server's prompt forms as a list of prompts, each text or ids with text mixed in:
    a list holding lists, objects or only strings is a batch."""
    def one(p):
        if isinstance(p, JsonPrompt):
            if p.multimodal_data:
                raise APIError(400, "multimodal data is not supported: specli serves text "
                               "models", param="prompt.multimodal_data")
            return p.prompt_string
        return p

    if not isinstance(prompt, list):
        return [one(prompt)]
    if any(isinstance(p, list | JsonPrompt) for p in prompt) or all(
            isinstance(p, str) for p in prompt):
        bare = next((i for i, p in enumerate(prompt) if isinstance(p, int)), None)
        if bare is not None:  # a batch holds prompts: a token id alone is none
            raise APIError(400, f"prompt[{bare}] is a token id in a batch of prompts: each "
                           "prompt is text, a list of ids or an object", param="prompt")
        return [one(p) for p in prompt]
    return [prompt]


async def _completion(body: LlamaCompletionRequest, prompt, request: Request, st: State,
                      pool: SlotPool) -> Response:
    ids = await _prompt_ids(st, prompt)
    spec = body.speculative
    flat = {k.name: getattr(body, f"spec_{k.field}") for k in DRAFTING}
    if spec is None and any(v is not None for v in (*flat.values(), body.spec_type,
                                                     body.spec_sampling)):
        spec = Speculative(**flat, type=body.spec_type, sampling=body.spec_sampling)
    sampling = Sampling(stop=body.stop, speculative=spec,
                        timings_per_token=body.timings_per_token, id_slot=body.id_slot,
                        return_progress=body.return_progress,
                        **{k: getattr(body, k) for k in Transforms.model_fields})
    job = await st.jobs(jobs.job, st, sampling, ids, body.n_predict, "n_predict",
                        n_probs=body.n_probs or None, post=bool(body.post_sampling_probs))
    job.cache_prompt = body.cache_prompt is not False
    job.return_tokens = bool(body.return_tokens)
    job.prompt_text = _text(st, ids)
    model, fields, gs = st.config.model_id, body.response_fields, jobs.settings(st, job)

    def final(dones: list[Done], gen: Generation) -> dict:
        out = f.llama_final(dones[0].text, dones[0], gen, model, gs)
        return f.pick(out, fields) if fields else out

    return await _answer(request, pool, job, bool(body.stream),
                         lambda gen: f.llama_events(gen, model, gs), final, done_marker=False)


@llama.post("/tokenize")
async def tokenize(body: TokenizeRequest, st: AppState, pool: Pool) -> dict:
    target = st.engine.target

    def run() -> list:
        parts = [body.content] if isinstance(body.content, str) else body.content
        ids: list[int] = []
        for i, part in enumerate(parts):
            if isinstance(part, int):
                ids.append(part)
            else:  # BOS, when asked for, only before the first piece of text
                ids += target.tokenize(part, add_special=body.add_special and i == 0,
                                       parse_special=body.parse_special)
        ids = _in_vocab(st, ids, "content")
        if not body.with_pieces:
            return ids
        return [{"id": t, "piece": _piece(target.token_bytes(t, special=True))} for t in ids]

    return {"tokens": await asyncio.to_thread(run)}


@llama.post("/detokenize")
async def detokenize(body: DetokenizeRequest, st: AppState, pool: Pool) -> dict:
    target = st.engine.target

    def run() -> str:  # a million ids: a second, off the event loop
        ids = _in_vocab(st, body.tokens, "tokens")
        return b"".join(target.token_bytes(t, special=True) for t in ids).decode(
            "utf-8", errors="replace")

    return {"content": await asyncio.to_thread(run)}


def _piece(raw: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not UTF-8 on their own (llama-server)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _in_vocab(st: State, ids: list[int], param: str) -> list[int]:
    n_vocab = st.engine.target.n_vocab
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{n_vocab - 1})",
                       param=param)
    return ids


# -- request handling -------------------------------------------------------------------------

def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _text(st: State, ids: list[int]) -> str:
    """The prompt as llama-server answers it: its tokens read back (BOS included)."""
    return b"".join(st.engine.target.token_bytes(t, special=True)
                    for t in ids).decode("utf-8", "replace")


def _prefill(body: ChatRequest) -> bool:
    """Whether the final assistant message is continued, as llama-server decides it."""
    last = body.messages[-1].role
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(400, "Cannot set both add_generation_prompt and continue_final_message "
                       "to true.", param="continue_final_message")
    if body.continue_final_message and last != "assistant":
        raise APIError(400, "continue_final_message needs the last message to be the "
                       "assistant's", param="continue_final_message")
    if body.continue_final_message is None and last == "assistant":
        if len(body.messages) >= 2 and body.messages[-2].role == "assistant":
            raise APIError(400, "Cannot have 2 or more assistant messages at the end of the "
                           "list.", param="messages")
        return True  # llama-server's prefill_assistant, whatever add_generation_prompt says
    return bool(body.continue_final_message)


@llama.post("/apply-template")
async def apply_template(body: ChatRequest, st: AppState, pool: Pool) -> dict:
    """The prompt a chat request would be given (llama-server's /apply-template)."""
    text = await _off_loop("messages", lambda: st.engine.render_messages(
        *_conversation(body), _chat_plan(st, body).opts), st=st)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a template may spell a lone surrogate ("\ud800")
        raise APIError(400, "the chat template wrote text that is not valid Unicode (a lone "
                       "surrogate)", param="messages") from None
    return {"prompt": text}


def _conversation(body: ChatRequest) -> tuple[list[dict], bool]:
    """The messages as the template takes them, and whether the last is continued
    (_prefill); a media part is a 400 that says what it is (specli serves text models: no
    projector, as llama-server without --mmproj)."""
    for i, m in enumerate(body.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if part.type in MEDIA:
                a = "an" if part.type[0] in "aeiou" else "a"
                raise APIError(400, f"{MEDIA[part.type]} input is not supported: specli "
                               f"serves text-only models ({a} {part.type} part)",
                               param=f"messages[{i}].content[{j}]")
    out, prefill = [_message(m) for m in body.messages], _prefill(body)
    last = body.messages[-1] if body.messages else None
    if last is not None and isinstance(last.content, list) and prefill:
        # a continued answer's parts are joined as llama.cpp renders a message's content
        # into the prompt it continues (common_chat_msg::render_content: a blank line)
        text = ""
        for p in last.content:
            text += ("\n\n" if text else "") + p.text
        out[-1]["content"] = text
    return out, prefill


def _message(m) -> dict:
    d = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        d["content"] = "".join(p.text for p in m.content)
    d.setdefault("content", "")
    return d


def _refuse_completion(body: CompletionRequest) -> None:
    if body.echo:
        raise refuse("echo")
    if body.suffix:
        raise refuse("suffix")
    if body.best_of not in (None, 1):
        raise refuse("best_of")


async def _prompt_ids(st: State, prompt: str | list[int | str]) -> list[int]:
    """A prompt's ids: text tokenized (special tokens parsed, BOS first), ids as they are,
    text inside a list of ids tokenized without BOS where it stands."""
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        return await _off_loop("prompt", st.engine.tokenize, prompt)
    if all(isinstance(p, int) for p in prompt):
        return list(_in_vocab(st, prompt, "prompt"))
    target = st.engine.target

    def mixed() -> list[int]:
        ids: list[int] = []
        for p in prompt:
            ids += [p] if isinstance(p, int) else target.tokenize(p, add_special=False)
        return ids

    return _in_vocab(st, await _off_loop("prompt", mixed), "prompt")


async def _off_loop(param: str, work: Callable, *args, st: State | None = None):
    """work(*args) off the event loop: a prompt tokenized, or a conversation planned,
    rendered and tokenized (on the request threads of st, where a render waiting for a
    template process never holds the threads that tokenize other requests). A prompt longer
    than the context (found before or after tokenizing) is an overflow naming the request's
    parameter that holds it; every template process busy, a 503."""
    try:
        if st is not None:
            return await st.prompts(work, *args)
        return await asyncio.to_thread(work, *args)
    except ContextOverflowError as e:
        raise overflow(e.message, e.n_prompt_tokens, e.n_ctx, param) from None
    except child.Busy as e:
        raise unavailable(e) from None
    except UsageError as e:  # what the template or the tokenizer would not take
        raise APIError(400, e.message, param=param) from None


async def start(pool: SlotPool, job: Job) -> Generation:
    try:
        slot = await pool.acquire(job.prompt, job.id_slot)
    except Busy as e:
        raise APIError(503, f"server busy: {e}", "unavailable_error", code="server_busy",
                       headers={"Retry-After": "1"}) from None
    if pool.down:  # an RPC server was lost while this request waited for the slot
        pool.release(slot)
        raise pool.unavailable()
    return pool.start(slot, job)


async def collect(gen: Generation, request: Request) -> list[Done]:
    """The whole answer, a Done per choice, cancelling the generation if the client goes
    away meanwhile."""
    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)
        gen.cancel()

    watcher = asyncio.create_task(watch())
    try:
        dones = [ev async for ev in gen.events() if isinstance(ev, Done)]
        if not dones:
            raise APIError(500, "the generation ended without a result", "server_error")
        return dones
    finally:
        watcher.cancel()
