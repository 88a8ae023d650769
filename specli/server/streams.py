"""Resumable streams, as llama-server keeps them (tools/server/server-stream.cpp): a streamed
answer whose request carries `X-Conversation-Id` is written to a buffer kept under that id, and
the generation runs to its end even if the client goes away. `GET /v1/stream?conv_id=ID&from=N`
replays the stream's bytes from offset N and follows it live; `DELETE /v1/stream?conv_id=ID`
stops it and forgets it; `POST /v1/streams/lookup` tells of the ids a caller names.

One conversation has at most one live stream (a new one cancels the old); a buffer keeps its
last 4 MiB (an offset before that is lost: a 400); a finished stream is kept 300 s. Everything
runs on the event loop: no locks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

MAX_BYTES = 4 * 1024 * 1024   # llama-server's STREAM_SESSION_MAX_BYTES
TTL = 300.0                   # seconds a finished stream stays replayable
GC_EVERY = 60.0               # seconds between the collector's looks (llama-server's)
MAX_SESSIONS = 256            # beyond: the oldest finished streams go first
MAX_KEPT = 256 * 1024 * 1024  # bytes of finished streams kept in all (likewise)
HEADER = "x-conversation-id"
LOOKUP_MAX = 1000             # ids a lookup may name


class Session:
    """One stream's bytes: its producer appends, any number of readers follow."""

    def __init__(self, conv_id: str):
        self.conv_id = conv_id
        self.started = int(time.time())
        self.completed = 0          # unix seconds once finished
        self.buffer = bytearray()
        self.dropped = 0            # bytes cut from the front (the cap)
        self.done = False
        self.cancelled = False
        self.producer: asyncio.Task | None = None
        self._changed = asyncio.Event()

    @property
    def total(self) -> int:
        return self.dropped + len(self.buffer)

    def append(self, data: bytes) -> None:
        if self.done or not data:
            return
        self.buffer += data
        if len(self.buffer) > MAX_BYTES:
            cut = len(self.buffer) - MAX_BYTES
            del self.buffer[:cut]
            self.dropped += cut
        self._wake()

    def finish(self) -> None:
        if not self.done:
            self.done, self.completed = True, int(time.time())
            self._wake()

    def cancel(self) -> None:
        """Stop the producer (its generation is cancelled) and end every reader."""
        self.cancelled = True
        if self.producer is not None and not self.producer.done():
            self.producer.cancel()
        self.finish()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def read(self, offset: int) -> AsyncIterator[bytes]:
        """The bytes from offset on, then each new piece until the stream ends (a reader
        the cap overtakes is told so, in the stream)."""
        while True:
            if offset < self.dropped:
                yield (f'data: {{"error":{{"message":"stream offset lost: the stream keeps '
                       f'its last {MAX_BYTES} bytes; replay from {self.dropped}",'
                       f'"type":"invalid_request_error"}}}}\n\n').encode()
                return
            if offset < self.total:
                chunk = bytes(self.buffer[offset - self.dropped:])
                offset += len(chunk)
                yield chunk
                continue
            if self.done:
                return
            await self._changed.wait()


class Streams:
    """The live and recently finished streams, by conversation id."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}

    def _prune(self, room: int = 0) -> None:
        """Drop what is past TTL, then the oldest finished streams while more than
        MAX_SESSIONS (room: ones about to open) or MAX_KEPT bytes are kept."""
        now = time.time()
        for cid, s in list(self.sessions.items()):
            if s.done and s.completed + TTL <= now:
                del self.sessions[cid]
        finished = sorted((s.completed, cid) for cid, s in self.sessions.items() if s.done)
        kept = sum(len(self.sessions[cid].buffer) for _, cid in finished)
        for _, cid in finished:
            if len(self.sessions) + room <= MAX_SESSIONS and kept <= MAX_KEPT:
                break
            kept -= len(self.sessions.pop(cid).buffer)

    def open(self, conv_id: str) -> Session:
        """A new stream for conv_id, cancelling the one it replaces."""
        self._prune(room=1)
        old = self.sessions.pop(conv_id, None)
        if old is not None:
            old.cancel()
        s = self.sessions[conv_id] = Session(conv_id)
        return s

    def get(self, conv_id: str) -> Session | None:
        self._prune()
        return self.sessions.get(conv_id)

    def stop(self, conv_id: str) -> None:
        s = self.sessions.pop(conv_id, None)
        if s is not None:
            s.cancel()

    def lookup(self, ids: list[str]) -> list[dict]:
        """The streams of the ids asked for (each id also matches `ID::model`), never others."""
        self._prune()
        out = []
        for rid in ids:
            for s in self.sessions.values():
                if s.conv_id == rid or s.conv_id.startswith(rid + "::"):
                    out.append({"conversation_id": s.conv_id, "is_done": s.done,
                                "total_bytes": s.total, "started_at": s.started,
                                "completed_at": s.completed})
        return out

    async def collect(self, every: float = GC_EVERY) -> None:
        """(the server's lifespan) Drop expired streams now and then, as llama-server's GC
        thread does: an idle server keeps nothing past TTL."""
        while True:
            await asyncio.sleep(every)
            self._prune()

    def close(self) -> None:
        for s in self.sessions.values():
            s.finish()
        self.sessions.clear()


def tee(body: AsyncIterator[str], session: Session, stop: Callable[[], None]
        ) -> AsyncIterator[bytes]:
    """Run body into session from a task of its own (it outlives the client), and follow the
    session for this client. stop (the generation's cancel) runs when the task ends, however
    it ends: a task cancelled before its first step runs no finally of body's."""
    async def produce() -> None:
        try:
            async for piece in body:
                session.append(piece.encode("utf-8", "replace"))
        finally:
            await body.aclose()  # type: ignore[attr-defined] - its finally frees the slot

    def ended(_: asyncio.Task) -> None:
        stop()
        session.finish()

    session.producer = asyncio.get_running_loop().create_task(produce())
    session.producer.add_done_callback(ended)
    return session.read(0)
