"""Slots: N engines, a bounded wait for a free one, and a generation that runs as a task of
the slots' one loop (batching.Scheduler) and streams to the event loop.

A slot is one Engine whose target and draft are sequences of two shared contexts (as in
llama-server); the loop combines the decodes its slots ask for into one llama_decode
(batching.SharedContext). A request waits for a
free slot in a bounded queue; when the queue is full, or the wait exceeds the timeout, it is
refused (503). A generation checks a cancel flag between tokens: a client that goes away
frees its slot after at most one speculative step, with both KV caches rewound by the
engine's own try/finally.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from specli import batching
from specli.batching import SharedContext
from specli.config import SamplingParams, SpecRequest
from specli.engine import Engine
from specli.server.errors import APIError
from specli.stats import Stats
from specli.verify import TokenProbs


class Busy(Exception):
    """No slot is free and the queue is full (or the wait timed out): answer 503."""


@dataclass
class Job:
    prompt: list[int]
    n_predict: int
    sampling: SamplingParams
    speculative: bool = True
    spec: SpecRequest | None = None
    stop: Sequence[str] = ()
    cache_prompt: bool = True  # False: start from an empty cache (llama-server's cache_prompt)
    return_tokens: bool = False  # /completion: the generated ids in `tokens`
    n: int = 1  # choices, generated one after another on the slot
    id_slot: int | None = None  # the slot asked for (None: the best idle one)
    return_progress: bool = False  # Progress events while the prompt is evaluated
    timings_per_token: bool = False  # each Piece carries the timings so far
    prompt_text: str = ""  # the prompt as the client gave it, for /completion's answer
    draft_prompt: list[int] | None = None  # a translating draft's own tokens for the prompt


@dataclass
class Piece:
    text: str
    probs: list[TokenProbs] = field(default_factory=list)  # of the tokens this text ends
    index: int = 0  # the choice
    tokens: list[int] = field(default_factory=list)  # the tokens this text ends
    stats: Stats | None = None  # the generation's so far (timings_per_token)


@dataclass
class Progress:
    """llama-server's prompt_progress: total, cache, processed, time_ms; timed: the request
    asked for timings_per_token (its progress chunks carry the timings so far too)."""

    progress: dict
    index: int = 0
    timed: bool = False


@dataclass
class Done:
    finish_reason: str  # stop, length, or cancelled
    stats: Stats
    text: str
    probs: list[TokenProbs] = field(default_factory=list)  # of every token sent
    tokens: list[int] = field(default_factory=list)  # every token generated
    stopping_word: str = ""  # the stop string that ended it, if one did
    index: int = 0  # the choice


class Pending:
    """Tokens waiting for their text: a token (and its probabilities) goes out with the
    piece that completes its text (text held back for a stop string holds it back too); a
    stop string's own tokens are never sent, as in llama-server."""

    def __init__(self) -> None:
        self.items: list[tuple[int, TokenProbs | None, int]] = []  # (token, probs, chars)
        self.sent = 0  # characters of the first item already sent

    def add(self, token: int | None, probs: TokenProbs | None, n_chars: int) -> None:
        if token is not None:
            self.items.append((token, probs, n_chars))

    def take(self, n_chars: int) -> tuple[list[int], list[TokenProbs]]:
        """The tokens (and the probs) whose text the next n_chars characters complete."""
        tokens, probs, budget = [], [], self.sent + n_chars
        while self.items and self.items[0][2] <= budget:
            token, p, n = self.items.pop(0)
            tokens.append(token)
            if p is not None:
                probs.append(p)
            budget -= n
        self.sent = budget
        return tokens, probs


@dataclass
class Slot:
    id: int
    engine: Engine
    busy: bool = False
    n_requests: int = 0
    last_used: float = 0.0  # monotonic time of its last release (least recently used first)
    job: Job | None = None  # the last request it served (GET /slots' params)
    # an idle slot whose cached prompt it takes over before its next generation
    # (SlotPool.choose), as long as that cache still shares more of the prompt than its own
    source: Slot | None = None


class StopMatcher:
    """Holds back as much text as could be the start of a stop string; cuts at the first."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.word = ""  # the stop string reached

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was reached)."""
        self.buf += text
        hits = [(i, s) for i, s in ((self.buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            i, self.word = min(hits)
            out, self.buf = self.buf[:i], ""
            return out, True
        cut = max(len(self.buf) - self.hold, 0)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class Generation:
    """One request on one slot; started at once, so the slot is released even if nobody
    reads the events."""

    def __init__(self, pool: SlotPool, slot: Slot, job: Job):
        self.slot, self.job = slot, job
        self._pool = pool
        self._on_done = pool.on_done
        self._cancel = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._released = False
        pool.active.add(self)
        fut = asyncio.wrap_future(pool.executor.submit(self._work), loop=self._loop)
        fut.add_done_callback(lambda _: self._release())

    def _release(self) -> None:
        """On the loop, once: the slot goes back to the pool."""
        if not self._released:
            self._released = True
            self._pool.active.discard(self)
            self._pool.release(self.slot)

    def _last(self, done: Done | BaseException) -> None:
        """On the loop: the slot is released before its reader sees the last Done (or the
        error that ended it), so that a client's next request (sent as soon as this answer
        arrives) finds the slot idle, its prompt cached (a release left to the thread's end
        raced the answer: the next request went to another slot and evaluated its prompt
        again, and /health right after an error counted the slot busy)."""
        self._release()
        self._queue.put_nowait(done)

    def cancel(self) -> None:
        self._cancel.set()

    async def events(self) -> AsyncIterator[Piece | Progress | Done]:
        """The text as it is generated, then a Done per choice; raises what the engine
        raised. A cancelled choice is the last."""
        n_done = 0
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Done):
                    n_done += 1
                    if n_done == self.job.n or item.finish_reason == "cancelled":
                        return
        finally:
            self._cancel.set()  # the reader left (or finished): stop at the next token

    def fail(self, error: BaseException) -> None:
        """End the generation with `error`, from any thread: its reader raises it."""
        self._push(error)

    def _push(self, item) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _work(self) -> None:
        engine, job = self.slot.engine, self.job
        if self._pool.down:  # started after the pool failed: fail() did not see it
            self._push(self._pool.unavailable())
            return
        try:
            src, self.slot.source = self.slot.source, None
            if not job.cache_prompt:
                engine.forget()
            elif src is not None and (_common(src.engine.target.tokens, job.prompt)
                                      > _common(engine.target.tokens, job.prompt)):
                # (on the loop, between decodes: the source's cache is as its tokens say)
                batching.move(_models(engine), _models(src.engine))
            for index in range(job.n):  # each choice in turn; the next reuses the prompt
                sp = job.sampling
                if index and sp.seed is not None:  # each choice its own seed
                    sp = replace(sp, seed=(sp.seed + index) % 2**63)
                done = self._choice(engine, job, sp, index)
                if index == job.n - 1 or done.finish_reason == "cancelled":
                    # the engine is left alone from here on: the slot may go at once
                    self._loop.call_soon_threadsafe(self._last, done)
                    break
                self._push(done)
        except BaseException as e:  # handed to the event loop, which answers the client
            # the engine's finally has run: the slot goes back before the client reads the
            # error, as it does before the last Done
            self._loop.call_soon_threadsafe(self._last, e)

    def _choice(self, engine: Engine, job: Job, sp: SamplingParams, index: int) -> Done:
        """One choice, streamed as Pieces; its Done (the caller sends it)."""
        stats = Stats()
        stop = StopMatcher(job.stop)
        pieces: list[str] = []
        pending, sent, tokens = Pending(), [], []
        finish = None
        progress = (lambda p: self._push(Progress(p, index, job.timings_per_token))
                    ) if job.return_progress else None
        chunks = engine.stream(job.prompt, job.n_predict, sp, job.speculative, job.spec,
                               stats, progress, job.draft_prompt)
        try:
            for chunk in chunks:  # one per token, then the last with the finish reason
                if chunk.finish_reason is None and self._cancel.is_set():
                    finish = "cancelled"
                    break
                if chunk.token is not None:
                    tokens.append(chunk.token)
                pending.add(chunk.token, chunk.probs, len(chunk.text))
                text, hit = stop.feed(chunk.text)
                if chunk.finish_reason is not None and not hit:  # the last chunk
                    text += stop.flush()
                ids, probs = pending.take(len(text))
                if text or ids:
                    pieces.append(text)
                    sent += probs
                    self._push(Piece(text, probs, index, ids,
                                     copy.deepcopy(stats) if job.timings_per_token else None))
                if hit:
                    finish = "stop"
                    break
        finally:
            chunks.close()  # the engine's finally: caches rewound, stats complete
        finish = finish or stats.finish_reason
        if self._on_done:
            self._on_done(stats)
        return Done(finish, stats, "".join(pieces), sent, tokens, stop.word, index)


@dataclass
class SlotPool:
    slots: list[Slot]
    max_queue: int = 16
    wait_s: float = 600.0
    on_done: Callable[[Stats], None] | None = None  # each generation's stats (metrics)
    contexts: list = field(default_factory=list)  # the SharedContexts the slots decode in
    on_close: Callable[[], None] | None = None  # after the slots are closed (grammar hosts)
    # llama-server's --slot-prompt-similarity: the idle slot whose cache holds the longest
    # prefix of the prompt, if more than this fraction of it; else the least recently used
    similarity: float = 0.1
    waiting: int = 0
    executor: Executor = field(init=False)

    def __post_init__(self) -> None:
        # the generations are tasks of the contexts' loop; slots of engines that share no
        # context (a test's fakes) run on threads of their own
        self.executor = next((c.sched for c in self.contexts if isinstance(c, SharedContext)),
                             None) or ThreadPoolExecutor(max_workers=len(self.slots),
                                                         thread_name_prefix="specli-slot")
        self.active: set[Generation] = set()
        self._free: asyncio.Queue | None = None
        self.down: str | None = None  # why no generation can run any more

    def _queue(self) -> asyncio.Queue:
        if self._free is None:  # made on the event loop that uses it
            self._free = asyncio.Queue()
            for s in self.slots:
                self._free.put_nowait(s)
        return self._free

    @property
    def idle(self) -> int:
        return sum(not s.busy for s in self.slots)

    async def acquire(self, prompt: Sequence[int] = (), slot_id: int | None = None) -> Slot:
        """A slot for the prompt: the one asked for (waiting for it if busy), else the idle
        one whose cache shares most of the prompt (llama-server's slot prompt similarity),
        else the least recently used."""
        free = self._queue()
        # the requests admitted before this one take the idle slots first, even those that
        # have not taken theirs yet (asyncio.wait_for runs _take as a task, a turn of the
        # loop later): counting only the queue let simultaneous requests past --max-queue 0
        queued = self.waiting - free.qsize()
        if queued >= self.max_queue:
            raise Busy(f"all {len(self.slots)} slots are busy and {max(queued, 0)} requests "
                       "wait")
        self.waiting += 1
        try:
            slot = await asyncio.wait_for(self._take(free, prompt, slot_id), self.wait_s)
        except TimeoutError:
            raise Busy(f"no slot became free within {self.wait_s:g} s") from None
        finally:
            self.waiting -= 1
        slot.busy = True
        slot.n_requests += 1
        return slot

    async def _take(self, free: asyncio.Queue, prompt: Sequence[int],
                    slot_id: int | None) -> Slot:
        while True:
            idle = [await free.get()]
            while not free.empty():  # no await from here on: the queue is ours
                idle.append(free.get_nowait())
            best = self.choose([s for s in idle if slot_id is None or s.id == slot_id], prompt)
            for s in idle:
                if s is not best:
                    free.put_nowait(s)
            if best is not None:
                return best
            await asyncio.sleep(0.02)  # the slot asked for is busy: look again soon

    def choose(self, idle: Sequence[Slot], prompt: Sequence[int]) -> Slot | None:
        """The idle slot that keeps the busy slots' sequences together: the fewest runs of
        consecutive ids, the lowest id among equals. With a cache stream a sequence
        llama.cpp decodes only consecutive sequences in one graph run, so slots 0, 2 and 5
        cost three runs a step where 0, 1 and 2 cost one (every step, for the whole
        generation). llama-server's prompt similarity still decides whose cache is used:
        the idle slot that holds the largest fraction of the prompt, if above the threshold
        (0 turns it off) and more than the chosen slot holds, lends it its cache (copied at
        the generation's start, Slot.source); where a cache cannot move (a draft head's,
        a tree's branches) that slot itself serves, as in llama-server."""
        if not idle:
            return None
        busy = {s.id for s in self.slots if s.busy}
        tight = min(idle, key=lambda s: (_runs(busy | {s.id}), s.id))
        tight.source = None
        if self.similarity > 0 and prompt:
            share, best = max(((_common(s.engine.target.tokens, prompt), s) for s in idle),
                              key=lambda x: (x[0], x[1] is tight))
            if (best is not tight and share / len(prompt) > self.similarity
                    and share > _common(tight.engine.target.tokens, prompt)):
                if not batching.movable(_models(tight.engine), _models(best.engine)):
                    return best
                tight.source = best
        return tight

    def release(self, slot: Slot) -> None:
        slot.busy = False
        slot.last_used = time.monotonic()
        self._queue().put_nowait(slot)

    def start(self, slot: Slot, job: Job) -> Generation:
        slot.job = job
        return Generation(self, slot, job)

    def fail(self, message: str) -> None:
        """The model cannot decode any more (an RPC server was lost): every generation in
        flight ends with a 503; their tasks stay where llama.cpp stopped the loop."""
        self.down = message  # first: a generation starting from now on sees it
        for g in list(self.active):
            g.fail(self.unavailable())

    def unavailable(self) -> APIError:
        return APIError(503, self.down or "unavailable", "unavailable_error",
                        code="unavailable", headers={"Retry-After": "5"})

    def close(self) -> None:
        if self.down:  # a decode is stuck in llama.cpp for good: nothing can be freed
            return
        for g in list(self.active):
            g.cancel()  # generations stop at their next token
        self.executor.shutdown(wait=True, cancel_futures=True)
        for s in self.slots:
            s.engine.close()
        for c in self.contexts:
            c.close()
        if self.on_close:
            self.on_close()


def _runs(ids: set[int]) -> int:
    """How many runs of consecutive numbers the ids make ({0, 1, 2, 5}: two)."""
    return sum(1 for i in ids if i - 1 not in ids)


def _models(engine: Engine) -> list:
    """The models whose caches make up a slot's: the target's, and its draft's."""
    return [engine.target] + ([engine.draft_model] if engine.draft_model is not None else [])


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
