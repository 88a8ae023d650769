"""The FastAPI app: OpenAI-compatible and llama-server routes over a pool of speculative slots.

`create_app(config)` returns the app; the slots load in a thread once it starts (/health says
503 until they are ready). Every error is answered in OpenAI's envelope
{"error": {"message", "type", "param", "code"}}; bad input is a 4xx, never a 500.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field, replace
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specli import __version__
from specli.config import (
    SPEC_TYPES,
    DraftPolicy,
    ModelParams,
    NgramParams,
    SamplingParams,
    SpecRequest,
)
from specli.engine import Engine, spec_key
from specli.errors import BackendError, SpecliError
from specli.server.metrics import CONTENT_TYPE, Metrics
from specli.server.schemas import (
    ChatRequest,
    CompletionRequest,
    LlamaCompletionRequest,
    Sampling,
    Speculative,
)
from specli.server.slots import Busy, Done, Generation, Job, Piece, Slot, SlotPool
from specli.stats import Stats

MAX_BODY = 8 << 20  # bytes: far more than any context holds as text


@dataclass(frozen=True)
class ServerConfig:
    """Everything `specli serve` decides before the app starts."""

    target: ModelParams
    draft: ModelParams | None = None
    draft_params: DraftPolicy = field(default_factory=DraftPolicy)
    spec_types: tuple[str, ...] = ()
    ngram: NgramParams = field(default_factory=NgramParams)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n_predict: int = -1
    parallel: int = 1
    api_keys: tuple[str, ...] = ()
    alias: str | None = None
    metrics: bool = False
    timeout: float = 600.0
    max_queue: int = 16
    max_body: int = MAX_BODY

    @property
    def model_id(self) -> str:
        return self.alias or os.path.basename(self.target.path)


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers


def envelope(status: int, message: str, type: str = "invalid_request_error",
             param: str | None = None, code: str | int | None = None,
             headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


class State:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.pool: SlotPool | None = None
        self.error: str | None = None
        self.metrics = Metrics()
        self.created = int(time.time())

    @property
    def engine(self) -> Engine:
        """Slot 0's engine, for tokenizing and templates (read-only, thread-safe calls)."""
        return self.pool.slots[0].engine

    def load(self) -> None:
        c = self.config
        n_ctx = max(c.target.n_ctx // c.parallel, 16)  # llama-server divides -c among slots
        target = replace(c.target, n_ctx=n_ctx)
        draft = replace(c.draft, n_ctx=max(c.draft.n_ctx // c.parallel, 16)) if c.draft else None
        engines, shared = Engine.load_slots(c.parallel, target, draft, c.draft_params,
                                            c.spec_types, c.ngram)
        self.pool = SlotPool([Slot(i, e) for i, e in enumerate(engines)], c.max_queue,
                             c.timeout, on_done=self.metrics.observe, contexts=shared)


async def _ready(request: Request) -> SlotPool:
    """The slots, or 503 while they load (or after loading failed)."""
    st: State = request.app.state.specli
    if st.pool is None:
        raise APIError(503, st.error or "Loading model", "unavailable_error",
                       code="unavailable")
    return st.pool


Pool = Annotated[SlotPool, Depends(_ready)]


def create_app(config: ServerConfig, on_fatal: Callable[[BaseException], None] | None = None,
               on_ready: Callable[[int], None] | None = None,
               state: State | None = None) -> FastAPI:
    """The app. `on_fatal` hears of a load failure (the CLI stops the server with it),
    `on_ready` of the slots being loaded; `state` lets a caller hand in slots it loaded."""
    st = state or State(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None
        if st.pool is None:
            async def load() -> None:
                try:
                    await asyncio.to_thread(st.load)
                except BaseException as e:  # noqa: BLE001 - reported, then the server stops
                    st.error = getattr(e, "message", None) or str(e)
                    if on_fatal:
                        on_fatal(e)
                    return
                if on_ready:
                    on_ready(len(st.pool.slots))
            task = asyncio.create_task(load())
        yield
        if task is not None:
            with suppress(BaseException):
                await task
        if st.pool is not None:
            await asyncio.to_thread(st.pool.close)

    app = FastAPI(title="specli", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible speculative decoding server (llama.cpp).")
    app.state.specli = st
    app.add_middleware(BodyLimit, limit=config.max_body)
    app.add_middleware(CountRequests, metrics=st.metrics)
    _handlers(app, st)

    async def auth(request: Request) -> None:
        keys = config.api_keys
        if not keys:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else \
            request.headers.get("x-api-key", "")
        if not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
            raise APIError(401, "Invalid API Key", "authentication_error",
                           code="invalid_api_key")

    guarded = [Depends(auth)]

    # -- public ---------------------------------------------------------------------------
    @app.get("/health")
    @app.get("/v1/health", include_in_schema=False)
    async def health() -> JSONResponse:
        if st.pool is None:
            return envelope(503, st.error or "Loading model", "unavailable_error",
                            code=503)
        return JSONResponse({"status": "ok", "slots_idle": st.pool.idle,
                             "slots_processing": len(st.pool.slots) - st.pool.idle})

    # -- information ------------------------------------------------------------------------
    @app.get("/v1/models", dependencies=guarded)
    @app.get("/models", dependencies=guarded, include_in_schema=False)
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": config.model_id, "object": "model", "created": st.created,
            "owned_by": "specli",
            "meta": {"path": config.target.path,
                     "draft": config.draft.path if config.draft else None}}]}

    @app.get("/props", dependencies=guarded)
    async def props(pool: Pool) -> dict:
        e = st.engine
        template = e.target.chat_template()
        from specli.chat import FALLBACK_TEMPLATE

        c = config
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
            "default_generation_settings": {
                "n_ctx": e.target.n_ctx, "n_predict": c.n_predict,
                "temperature": c.sampling.temp, "top_k": c.sampling.top_k,
                "top_p": c.sampling.top_p, "min_p": c.sampling.min_p,
            },
            "speculative": {
                "draft_model": c.draft.path if c.draft else None,
                "types": list(spec_key([*c.spec_types,
                                        *(["draft-simple"] if c.draft else [])])),
                "n_max": c.draft_params.n_max, "n_min": c.draft_params.n_min,
                "p_min": c.draft_params.p_min, "auto": c.draft_params.adaptive,
            },
        }

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        if not config.metrics:
            raise APIError(404, "metrics are off: start the server with --metrics",
                           "not_found_error", code="metrics_disabled")
        pool = st.pool
        body = st.metrics.render(len(pool.slots) - pool.idle if pool else 0,
                                 len(pool.slots) if pool else 0, pool.waiting if pool else 0)
        return Response(body, media_type=CONTENT_TYPE)

    # -- generation -------------------------------------------------------------------------
    @app.post("/v1/chat/completions", dependencies=guarded)
    @app.post("/chat/completions", dependencies=guarded, include_in_schema=False)
    async def chat(body: ChatRequest, request: Request,
                   pool: Pool) -> Response:
        _refuse_chat(body)
        messages = [_message(m) for m in body.messages]
        ids = st.engine.tokenize_messages(messages)
        n = _first(body.max_completion_tokens, body.max_tokens)
        job = _job(st, body, ids, n, "max_tokens")
        gen = await _start(pool, job)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": config.model_id}
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_chat_events(gen, head, usage), gen)
        text, done = await _collect(gen, request)
        return JSONResponse({
            **head, "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": _finish(done), "logprobs": None}],
            "usage": _usage(done.stats), "timings": _timings(done.stats)})

    @app.post("/v1/completions", dependencies=guarded)
    @app.post("/completions", dependencies=guarded, include_in_schema=False)
    async def completions(body: CompletionRequest, request: Request,
                          pool: Pool) -> Response:
        _refuse_completion(body)
        ids = _prompt_ids(st, body.prompt[0] if isinstance(body.prompt, list) and
                          isinstance(body.prompt[0], str) else body.prompt)
        job = _job(st, body, ids, body.max_tokens, "max_tokens")
        gen = await _start(pool, job)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": config.model_id, "object": "text_completion"}
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_completion_events(gen, head, usage), gen)
        text, done = await _collect(gen, request)
        return JSONResponse({
            **head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": _finish(done)}],
            "usage": _usage(done.stats), "timings": _timings(done.stats)})

    @app.post("/completion", dependencies=guarded)
    async def completion(body: LlamaCompletionRequest, request: Request,
                         pool: Pool) -> Response:
        if body.n_probs:
            raise APIError(400, "n_probs is not supported", param="n_probs")
        ids = _prompt_ids(st, body.prompt)
        spec = body.speculative
        if spec is None and any(v is not None for v in (
                body.spec_n_max, body.spec_n_min, body.spec_p_min, body.spec_type)):
            spec = Speculative(n_max=body.spec_n_max, n_min=body.spec_n_min,
                               p_min=body.spec_p_min, type=body.spec_type)
        sampling = Sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                            min_p=body.min_p, seed=body.seed, stop=body.stop,
                            speculative=spec)
        job = _job(st, sampling, ids, body.n_predict, "n_predict")
        gen = await _start(pool, job)
        if body.stream:
            return _sse(_llama_events(gen, config.model_id), gen, done_marker=False)
        text, done = await _collect(gen, request)
        return JSONResponse(_llama_final(text, done, gen, config.model_id))

    return app


# -- request handling --------------------------------------------------------------------------

def _first(*values):
    return next((v for v in values if v is not None), None)


def _message(m) -> dict:
    d = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        d["content"] = "".join(p.text for p in m.content)
    d.setdefault("content", "")
    return d


def _refuse(param: str, why: str = "is not supported by specli") -> APIError:
    return APIError(400, f"{param} {why}", param=param, code="unsupported_parameter")


def _refuse_common(body: Sampling) -> None:
    if body.n not in (None, 1):
        raise _refuse("n", "must be 1: one completion per request")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise _refuse(name)
    if body.logit_bias:
        raise _refuse("logit_bias")


def _refuse_chat(body: ChatRequest) -> None:
    _refuse_common(body)
    if body.logprobs or body.top_logprobs:
        raise _refuse("logprobs")
    if body.tools or body.tool_choice not in (None, "none"):
        raise _refuse("tools")
    if body.response_format and body.response_format.get("type") != "text":
        raise _refuse("response_format")


def _refuse_completion(body: CompletionRequest) -> None:
    _refuse_common(body)
    if body.logprobs:
        raise _refuse("logprobs")
    if body.echo:
        raise _refuse("echo")
    if body.suffix:
        raise _refuse("suffix")
    if body.best_of not in (None, 1):
        raise _refuse("best_of")


def _prompt_ids(st: State, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        return st.engine.target.tokenize(prompt)
    n_vocab = st.engine.target.n_vocab
    bad = next((t for t in prompt if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{n_vocab - 1})",
                       param="prompt")
    return list(prompt)


def _job(st: State, body: Sampling, ids: list[int], n_predict: int | None,
         n_param: str) -> Job:
    c = st.config
    n_ctx = st.engine.target.n_ctx
    if body.model is not None and body.model not in _model_names(c):
        raise APIError(400, f"the model '{body.model}' does not exist: this server has "
                       f"'{c.model_id}'", param="model", code="model_not_found")
    if n_predict is not None and n_predict < 1 and not (n_param == "n_predict"
                                                        and n_predict == -1):
        raise APIError(400, f"{n_param} must be at least 1, got {n_predict}", param=n_param)
    if n_predict is not None and n_predict > n_ctx:
        raise APIError(400, f"{n_param} is {n_predict}, more than the context holds "
                       f"({n_ctx} tokens per slot)", param=n_param)
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    if len(ids) >= n_ctx:
        raise APIError(400, f"the prompt is {len(ids)} tokens, the context holds {n_ctx} per "
                       "slot", param="messages" if n_param == "max_tokens" else "prompt",
                       code="context_length_exceeded")
    s = c.sampling
    sampling = SamplingParams(
        temp=_first(body.temperature, s.temp), top_k=_first(body.top_k, s.top_k),
        top_p=_first(body.top_p, s.top_p), min_p=_first(body.min_p, s.min_p),
        seed=s.seed if body.seed is None else None if body.seed < 0 else body.seed)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    speculative, spec = _spec(st, body.speculative)
    return Job(ids, _first(n_predict, c.n_predict), sampling, speculative, spec, stop)


def _spec(st: State, spec: Speculative | bool | None) -> tuple[bool, SpecRequest | None]:
    if spec is None or spec is True:
        return True, None
    if spec is False:
        return False, None
    types = None
    if spec.type is not None:
        names = [t.strip() for t in spec.type.split(",") if t.strip()]
        unknown = [t for t in names if t not in SPEC_TYPES]
        if unknown or not names:
            raise APIError(400, f"unknown speculative type {', '.join(unknown) or spec.type!r}: "
                           f"one or more of {', '.join(SPEC_TYPES)}", param="speculative.type")
        if "draft-simple" in names and st.config.draft is None:
            raise APIError(400, "speculative type draft-simple needs a draft model: start the "
                           "server with -md", param="speculative.type")
        types = spec_key(names)
    if spec.n_min is not None and spec.n_max is not None and spec.n_min > spec.n_max:
        raise APIError(400, "speculative.n_min is larger than speculative.n_max",
                       param="speculative.n_min")
    return True, SpecRequest(types, spec.n_max, spec.n_min, spec.p_min)


def _model_names(c: ServerConfig) -> set[str]:
    base = os.path.basename(c.target.path)
    return {c.model_id, base, os.path.splitext(base)[0], c.target.path}


async def _start(pool: SlotPool, job: Job) -> Generation:
    try:
        slot = await pool.acquire()
    except Busy as e:
        raise APIError(503, f"server busy: {e}", "unavailable_error", code="server_busy",
                       headers={"Retry-After": "1"}) from None
    return pool.start(slot, job)


async def _collect(gen: Generation, request: Request) -> tuple[str, Done]:
    """The whole answer, cancelling the generation if the client goes away meanwhile."""
    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)
        gen.cancel()

    watcher = asyncio.create_task(watch())
    try:
        async for ev in gen.events():
            if isinstance(ev, Done):
                return ev.text, ev
        raise APIError(500, "the generation ended without a result", "server_error")
    finally:
        watcher.cancel()


def _finish(done: Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def _usage(s: Stats) -> dict:
    return {"prompt_tokens": s.n_prompt, "completion_tokens": s.n_predict,
            "total_tokens": s.n_prompt + s.n_predict,
            "speculative": {"drafts": s.n_steps, "draft_n": s.n_drafted,
                            "draft_n_accepted": s.n_accept,
                            "accept_rate": round(s.accept_rate, 4)}}


def _timings(s: Stats) -> dict:
    """llama-server's timings object, with the draft figures always present."""
    prompt_n = s.target.prompt_n + 1 if s.n_prompt else 0  # the last prompt token opens step 1
    prompt_ms, predicted_ms = 1e3 * s.t_encode_s, 1e3 * s.t_decode_s

    def per(n: float, ms: float) -> tuple[float, float]:
        return (ms / n if n else 0.0), (1e3 * n / ms if ms else 0.0)

    p_tok, p_sec = per(prompt_n, prompt_ms)
    g_tok, g_sec = per(s.n_predict, predicted_ms)
    return {"cache_n": max(s.n_prompt - prompt_n, 0),
            "prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": p_tok,
            "prompt_per_second": p_sec, "predicted_n": s.n_predict,
            "predicted_ms": predicted_ms, "predicted_per_token_ms": g_tok,
            "predicted_per_second": g_sec, "draft_n": s.n_drafted,
            "draft_n_accepted": s.n_accept, "draft_accept_rate": s.accept_rate,
            "draft_accepted_per_position": s.accept_rate_per_pos}


def _data(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _sse(events: AsyncIterator[str], gen: Generation, done_marker: bool = True) -> Response:
    async def body() -> AsyncIterator[str]:
        try:
            async for line in events:
                yield line
            if done_marker:
                yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the status line is sent: say it in the stream
            kind = "invalid_request_error" if isinstance(e, SpecliError) and not isinstance(
                e, BackendError) else "server_error"
            yield _data({"error": {"message": getattr(e, "message", None) or str(e),
                                   "type": kind, "param": None, "code": None}})
        finally:
            gen.cancel()  # a client that went away frees its slot at the next token

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _chat_events(gen: Generation, head: dict, usage: bool) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(delta: dict, finish: str | None = None) -> str:
        return _data({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                           "finish_reason": finish}]})

    yield chunk({"role": "assistant", "content": ""})
    async for ev in gen.events():
        if isinstance(ev, Piece):
            yield chunk({"content": ev.text})
        else:
            yield chunk({}, _finish(ev))
            if usage:
                yield _data({**head, "choices": [], "usage": _usage(ev.stats),
                             "timings": _timings(ev.stats)})


async def _completion_events(gen: Generation, head: dict, usage: bool) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None = None) -> str:
        return _data({**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                           "finish_reason": finish}]})

    async for ev in gen.events():
        if isinstance(ev, Piece):
            yield chunk(ev.text)
        else:
            yield chunk("", _finish(ev))
            if usage:
                yield _data({**head, "choices": [], "usage": _usage(ev.stats),
                             "timings": _timings(ev.stats)})


async def _llama_events(gen: Generation, model: str) -> AsyncIterator[str]:
    async for ev in gen.events():
        if isinstance(ev, Piece):
            yield _data({"content": ev.text, "stop": False, "id_slot": gen.slot.id})
        else:
            yield _data({**_llama_final("", ev, gen, model)})


def _llama_final(text: str, done: Done, gen: Generation, model: str) -> dict:
    s = done.stats
    # llama-server's stop types: limit (n_predict), eos (end of generation), word (a stop)
    stop_type = "limit" if done.finish_reason == "length" else \
        "eos" if s.finish_reason == "stop" else "word"
    return {"content": text, "id_slot": gen.slot.id, "stop": True, "model": model,
            "tokens_predicted": s.n_predict, "tokens_evaluated": s.n_prompt,
            "stop_type": stop_type, "truncated": False, "timings": _timings(s)}


# -- errors ------------------------------------------------------------------------------------

def _handlers(app: FastAPI, st: State) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return envelope(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        kind = err.get("type", "")
        if kind == "json_invalid":
            return envelope(400, "the body is not valid JSON", code="invalid_json")
        if kind == "extra_forbidden":
            return envelope(400, f"unknown parameter '{param}'", param=param,
                            code="unknown_parameter")
        if loc == [] and kind in ("model_attributes_type", "dict_type"):
            return envelope(400, "the request body must be a JSON object", code="invalid_json")
        if kind == "missing":
            return envelope(400, f"'{param}' is required", param=param, code="missing")
        return envelope(400, f"{param or 'body'}: {err.get('msg', 'invalid')}", param=param,
                        code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 400 and "parsing the body" in str(e.detail):
            return envelope(400, "the body is not valid JSON", code="invalid_json")
        kind, code = {404: ("not_found_error", "not_found"),
                      405: ("invalid_request_error", "method_not_allowed")}.get(
            e.status_code, ("invalid_request_error", None))
        return envelope(e.status_code, str(e.detail), kind, code=code,
                        headers=getattr(e, "headers", None))

    @app.exception_handler(SpecliError)
    async def specli_error(request: Request, e: SpecliError) -> JSONResponse:
        if isinstance(e, BackendError):
            return envelope(500, e.message, "server_error")
        return envelope(400, e.message)

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception) -> JSONResponse:
        return envelope(500, f"internal error: {type(e).__name__}: {e}", "server_error")


class CountRequests:
    """specli_requests_total by route and status: a pure ASGI middleware (Starlette's
    BaseHTTPMiddleware would hide a client's disconnect from the routes)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def sent(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            path = getattr(scope.get("route"), "path", "other")
            self.metrics.requests.labels(route=path, code=str(status[0])).inc()


class BodyLimit:
    """413 for a request body over the limit, counted as it arrives (chunked or not)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large(scope, receive, send)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        response = envelope(413, f"the request body is over {self.limit} bytes",
                            code="request_too_large")
        await response(scope, receive, send)
