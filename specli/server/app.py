"""The FastAPI app: OpenAI-compatible and llama-server routes over a pool of speculative slots.

`create_app(config)` returns the app; the slots load in a thread once it starts (/health says
503 until they are ready). The routes are in routes.py, one router per family; errors.py
answers every error in OpenAI's envelope; formats.py writes usage, timings and streams.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI

from specli import __version__
from specli.server import compat, errors, routes
from specli.server.errors import envelope
from specli.server.metrics import Metrics
from specli.server.state import MAX_BODY, ServerConfig, State

__all__ = ["MAX_BODY", "ServerConfig", "State", "create_app"]


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
        gc = asyncio.create_task(st.streams.collect())
        yield
        gc.cancel()
        if st.down:  # a decode (or the load) is stuck in llama.cpp for good: nothing to wait for
            sys.stderr.write(f"specli serve: error: stopped while {st.down}\n")
            sys.stderr.flush()
            os._exit(2)
        if task is not None:
            with suppress(BaseException):
                await task
        st.streams.close()  # a reader following a live stream ends
        if st.pool is not None:
            await asyncio.to_thread(st.pool.close)

    # no /docs or /redoc, and the schema is served behind the key (routes.info)
    app = FastAPI(title="specli", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible speculative decoding server (llama.cpp).",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specli = st
    app.add_middleware(BodyLimit, limit=config.max_body)
    app.add_middleware(CountRequests, metrics=st.metrics)
    app.add_middleware(Cors, config=config)  # a preflight needs no key
    app.add_middleware(HeaderCase)  # outermost: every answer's header names, Cors's too
    errors.install(app)
    for router in (routes.public, routes.info, routes.openai, routes.llama, compat.router):
        app.include_router(router)
    return app


class Cors:
    """llama-server's CORS: every response names the allowed origin (by default any Origin
    is echoed back, credentials allowed); an OPTIONS preflight is answered at once, before
    the key is checked, with the allowed methods and headers. --cors-origins localhost
    echoes only a localhost Origin; a list echoes an Origin it holds."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.c = app, config

    def allow(self, origin: str) -> str | None:
        want = self.c.cors_origins.strip()
        if want == "*":
            return (origin or None) if self.c.cors_credentials else "*"
        if want == "localhost":
            return origin if origin and _localhost(origin) else None
        listed = {o.strip() for o in want.split(",") if o.strip()}
        return origin if origin in listed else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        origin = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"origin"), "")
        allowed = self.allow(origin)
        # (llama-server's casing: clients that keep headers in a plain dict look it up so)
        extra = [(b"Access-Control-Allow-Origin", allowed.encode("latin-1"))] if allowed else []
        if scope["method"] == "OPTIONS":
            extra += [(b"Access-Control-Allow-Credentials",
                       b"true" if self.c.cors_credentials else b"false"),
                      (b"Access-Control-Allow-Methods", self.c.cors_methods.encode()),
                      (b"Access-Control-Allow-Headers", self.c.cors_headers.encode()),
                      (b"content-type", b"text/html"), (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 200, "headers": extra})
            await send({"type": "http.response.body", "body": b""})
            return

        async def sent(message):
            if message["type"] == "http.response.start" and extra:
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, sent)


def _localhost(origin: str) -> bool:
    """Whether an Origin is this machine: localhost, 127.0.0.1 or [::1], any scheme/port."""
    from urllib.parse import urlsplit

    try:
        host = urlsplit(origin if "//" in origin else f"//{origin}").hostname
    except ValueError:
        return False
    return host in ("localhost", "127.0.0.1", "::1")


class HeaderCase:
    """Response header names as llama-server spells them (Content-Type,
    Process-Start-Time-Unix): Starlette lower-cases them, and h11 sends a name as the app
    gives it. HTTP says case does not matter; a client that reads headers into a plain dict
    (llama.cpp's own test suite does) sees the difference. Names only, once per answer."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def sent(message):
            if message["type"] == "http.response.start":
                message["headers"] = [(header_name(k), v) for k, v in message.get("headers", ())]
            await send(message)

        await self.app(scope, receive, sent)


_SPELLED = {b"www-authenticate": b"WWW-Authenticate"}


@functools.lru_cache(maxsize=256)
def header_name(name: bytes) -> bytes:
    """A header name in the usual spelling: each dash-separated word capitalised."""
    return _SPELLED.get(name.lower()) or b"-".join(w.capitalize() for w in name.split(b"-"))


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


_ESCAPE = re.compile(rb"(\\+)u([dD][89a-fA-F][0-9a-fA-F]{2})")


def lone_surrogate(body: bytes) -> int | None:
    """The byte offset of a JSON escape of a lone UTF-16 surrogate ("\\ud800" not in a
    pair), or None. One regex pass; only bodies that hold such escapes are looked at closer."""
    expect_low = -1  # where a low surrogate must follow
    for m in _ESCAPE.finditer(body):
        if len(m.group(1)) % 2 == 0:  # "\\\\ud800": an escaped backslash, then text
            continue
        start = m.start(1) + len(m.group(1)) - 1
        low = m.group(2)[1:2].lower() in (b"c", b"d", b"e", b"f")
        if expect_low >= 0:
            if low and start == expect_low:
                expect_low = -1
                continue
            return expect_low - 6
        if low:
            return start
        expect_low = m.end()
    return expect_low - 6 if expect_low >= 0 else None


def _as_json(scope: dict) -> None:
    """In place: the outer middleware reads what the router writes into this scope."""
    headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"]
    scope["headers"] = [*headers, (b"content-type", b"application/json")]


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
        try:
            body.decode("utf-8")  # JSON travels as UTF-8 (RFC 8259); json.loads would take more
        except UnicodeDecodeError as e:
            return await envelope(400, f"the body is not valid UTF-8 (byte {e.start})",
                                  code="invalid_json")(scope, receive, send)
        at = lone_surrogate(body)
        if at is not None:  # json.loads would make it a str that no UTF-8 encoder takes
            return await envelope(400, f"the body holds a lone UTF-16 surrogate escape at byte "
                                  f"{at}, which is not valid Unicode",
                                  code="invalid_unicode")(scope, receive, send)
        if body and scope["method"] == "POST":  # `curl -d` says form-urlencoded: llama-server
            _as_json(scope)                      # parses any body as JSON, and so do we

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
