"""The connection layer: uvicorn's h11 protocol with what production servers add in front of it.

uvicorn times nothing out before a request's head is complete: a connection that sends nothing,
or a head at one byte a second, is held for good (its keep-alive timer is disarmed by every byte
received), and 20,000 of them use up the process's descriptors. So each connection here has
HEAD_S seconds for each request's head (nginx's client_header_timeout, Apache's
RequestReadTimeout), from the connection's start or from the first byte after the previous
answer, and BODY_S for its body; over either, a 408 and the socket closed. And at most
`limit()` connections are open at once, half of them from any one client address: one more
is answered 503 and closed at once, so that descriptors never run out, /health answers (or is
refused) instead of hanging, and one client cannot lock the others out.
"""

from __future__ import annotations

import asyncio
import json
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_S = 10.0  # seconds for a request's head
BODY_S = 60.0  # seconds for its body, from the end of its head (8 MiB at 140 KB/s)
RESERVED_FDS = 256  # descriptors kept for the models, the grammar processes, logs


def raise_fd_limit() -> int:
    """The soft limit on open descriptors raised to the hard one (as nginx's
    worker_rlimit_nofile would); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = 1 << 16 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def limit(soft: int | None = None) -> int:
    """How many connections may be open at once: what the descriptors allow, up to 4096."""
    if soft is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(16, min(4096, soft - RESERVED_FDS))


def _answer(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error"
                                 if status < 500 else "unavailable_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class Guarded(asyncio.Protocol):
    """One connection: uvicorn's H11Protocol inside, a head deadline and the connection cap
    around it. uvicorn makes one per connection with its own arguments (Config(http=...))."""

    max_open = limit()
    open = 0  # connections held now, in this process
    by_client: dict[str, int] = {}  # of them, per client address: one may hold half

    def __init__(self, *args, **kw):
        self.inner = H11Protocol(*args, **kw)
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.counted = False
        self.started = False  # a first request's head has been completed

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else "local"
        mine = Guarded.by_client.get(self.client, 0)
        if Guarded.open >= Guarded.max_open or mine >= max(Guarded.max_open // 2, 8):
            transport.write(_answer(503, "Service Unavailable", f"the server holds "
                                    f"{Guarded.open} connections ({mine} from this client), "
                                    "its limit: try again", "too_many_connections"))
            transport.close()
            return
        Guarded.open += 1
        Guarded.by_client[self.client] = mine + 1
        self.counted = True
        self.inner.connection_made(transport)
        self._arm()  # the first head's time runs from now

    def data_received(self, data: bytes) -> None:
        if not self.counted:
            return
        self.inner.data_received(data)
        self._watch()

    def eof_received(self):
        return self.inner.eof_received() if self.counted else None

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self.counted:
            self.counted = False
            Guarded.open -= 1
            left = Guarded.by_client.pop(self.client, 1) - 1
            if left > 0:
                Guarded.by_client[self.client] = left
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.counted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.counted:
            self.inner.resume_writing()

    # -- the deadlines -----------------------------------------------------------------------
    def _phase(self) -> str | None:
        """"head" while the client is between requests with part of the next head sent (or,
        on a new connection, with its first head still to come), "body" while it sends a
        body, else None (the server's turn, or an idle keep-alive: uvicorn's timer)."""
        conn = self.inner.conn
        if conn.their_state is h11.SEND_BODY:
            self.started = True
            return "body"
        if conn.their_state is not h11.IDLE:
            self.started = True
            return None
        return "head" if not self.started or conn.trailing_data[0] else None

    def _watch(self) -> None:
        phase = self._phase()
        if phase is None:
            self._disarm()
        elif phase != self.armed:
            self._arm(phase)

    armed: str | None = None

    def _arm(self, phase: str = "head") -> None:
        self._disarm()
        self.armed = phase
        self.timer = asyncio.get_running_loop().call_later(
            HEAD_S if phase == "head" else BODY_S, self._expired)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.armed = None

    def _expired(self) -> None:
        phase, self.timer, self.armed = self.armed, None, None
        if self.transport is None or self.transport.is_closing() or self._phase() != phase:
            return
        what, limit = ("head", HEAD_S) if phase == "head" else ("body", BODY_S)
        self.transport.write(_answer(408, "Request Timeout", f"the request's {what} did not "
                                     f"arrive within {limit:g} s", "request_timeout"))
        self.transport.close()
