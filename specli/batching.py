"""Batching for a server's slots: several sequences of one llama_context, whose decodes
are combined into one llama_decode, as llama-server does. One loop (Scheduler) runs every
slot's generation as a task and makes every decode, over backend.Model's public decode API;
it holds no llama.cpp handle of its own."""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass, replace

import greenlet
import numpy as np

from specli.backend.model import Model, Ran
from specli.config import ModelParams
from specli.errors import BackendError


def movable(dst: Sequence[object], src: Sequence[object]) -> bool:
    """Whether move(dst, src) can copy each of src's models' sequences into dst's (a slot's
    target and draft: sequences of the same contexts, without tree branches; a draft head's
    cache cannot move)."""
    return len(dst) == len(src) and all(
        isinstance(d, Model) and d.shares(s) for d, s in zip(dst, src, strict=True))


def move(dst: Sequence[Model], src: Sequence[Model]) -> bool:
    """Each of dst's sequences becomes a copy of src's (a server slot taking over another's
    cached prompt, on the loop between decodes); False, and nothing copied, where they
    cannot (movable)."""
    if not movable(dst, src):
        return False
    for d, s in zip(dst, src, strict=True):
        d.adopt(s)
    return True


class Scheduler(Executor):
    """The server's one loop (llama-server's update_slots), on one thread: every slot's
    generation is a task (a greenlet) on it, and every decode runs on it. An iteration
    resumes the tasks whose decodes are done, each until it asks for its next decode (it
    queues a _Request at a SharedContext and parks), then makes one decode of what a
    context holds: the draft's first while any slot drafts there, so that every slot's
    verification meets in one target decode. Nothing waits on time: once every task is
    parked, nothing else can join a decode. One thread also keeps ggml's OpenMP to one team
    of threads (decodes from the slots' rotating threads ran 25% slower, two teams on 2 cores
    twice as slow)."""

    def __init__(self) -> None:
        self.contexts: list[SharedContext] = []
        self.lock = threading.Lock()  # held by a decode, and by an edit from another thread
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: deque[tuple[greenlet.greenlet, tuple]] = deque()
        self._last: SharedContext | None = None  # the context decoded last
        self._hub: greenlet.greenlet | None = None
        self._tasks: set[Future] = set()
        self._thread = threading.Thread(target=self._loop, name="specli-decode", daemon=True)
        self._thread.start()

    # -- Executor: work handed to the loop from other threads ---------------------------------
    def submit(self, fn, /, *args, **kw) -> Future:
        """fn(*args) as a task of the loop (at once, inline, from one of its own tasks)."""
        if not self._thread.is_alive():
            raise BackendError("the model's context is closed (the server is stopping)")
        fut: Future = Future()
        if self.on_thread():
            self._task(fn, args, kw, fut)
        else:
            self._inbox.put([(fn, args, kw, fut)])
        return fut

    def submit_all(self, calls: Sequence[Callable[[], object]]) -> list[Future]:
        """Several tasks that start in the same iteration (their first decodes combined)."""
        futs = [Future() for _ in calls]
        self._inbox.put([(fn, (), {}, f) for fn, f in zip(calls, futs, strict=True)])
        return futs

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Waits for the tasks running (the thread itself ends with its last context)."""
        if wait and not self.on_thread():
            futures.wait(list(self._tasks))

    def on_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def remove(self, ctx: SharedContext) -> None:
        """(on the loop) Its last context gone, the loop ends once its woken tasks have run."""
        self.contexts.remove(ctx)
        if not self.contexts:
            self._inbox.put(None)

    # -- from the loop's tasks ----------------------------------------------------------------
    def park(self) -> None:
        """The calling task waits for the loop to wake it (its request decoded)."""
        if self._hub is None or greenlet.getcurrent() is self._hub:
            raise BackendError("internal: a decode outside the scheduler's tasks")
        self._hub.switch()

    def wake(self, task: greenlet.greenlet) -> None:
        self._ready.append((task, ()))

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        self._hub = greenlet.getcurrent()
        stop = False
        while not stop:
            items = []
            try:  # wait only when nothing is left to do
                items.append(self._inbox.get(block=not self._ready and not self._work()))
                while True:
                    items.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            for calls in items:
                if calls is None:
                    stop = True
                    continue
                for call in calls:
                    self._ready.append((greenlet.greenlet(self._task), call))
            while self._ready:  # each task until it parks at a decode, or ends
                task, args = self._ready.popleft()
                task.switch(*args)
            ctx = self._pick()
            if ctx is not None:
                self._last = ctx
                ctx.step()

    def _task(self, fn, args, kw, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        self._tasks.add(fut)
        try:
            fut.set_result(fn(*args, **kw))
        except BaseException as e:  # noqa: BLE001 - the future holds it
            fut.set_exception(e)
        finally:
            self._tasks.discard(fut)

    def _work(self) -> bool:
        return any(c.pending for c in self.contexts)

    def _pick(self) -> SharedContext | None:
        """The context to decode: the first (the draft's) holding a slot's step, so that the
        slots draft first and meet at the verification; but a context ahead of it holding
        only prompts (a new request's draft prefill) takes every other turn, or it would
        wait for as long as the slots keep stepping."""
        live = [c for c in self.contexts if c.pending]
        steps = next((c for c in live if c.has_steps()), None)
        if steps is None:
            return live[0] if live else None
        for c in live[:live.index(steps)]:  # holding only prompts
            if c is not self._last:
                return c
        return steps


class SharedContext:
    """One llama_context holding several sequences (server slots), as llama-server does.

    Each slot decodes through its own SeqModel, from its task on the Scheduler's loop; the
    decodes queued here when the loop comes to this context are combined into one
    llama_decode (a batch of several sequences costs much less than as many single decodes
    on this CPU, and more so on a GPU), and each slot gets a copy of its own logits rows.
    A decode asked for from another thread runs as a task of its own."""

    def __init__(self, params: ModelParams, n_seq: int, sched: Scheduler | None = None,
                 first: bool = False, width: int = 1, tree_cells: int = 0,
                 timed: Callable[[int, float], None] | None = None):
        self.params = params
        # told each step decode's tokens in all and its seconds (--draft auto's batch cost:
        # the target's verifications, the draft's positions side by side)
        self.timed = timed
        self.chunk = min(params.n_ubatch, params.n_batch)  # prompt tokens in one decode
        self.n_seq = n_seq
        # llama-server's n_decode_total and n_busy_slots_per_decode: combined decodes, and
        # the slots in them (each decode counted once, however many slots it holds)
        self.n_decodes = self.n_seq_decodes = 0
        self.width = width  # draft-tree branches per slot: sequences seq*width.. of each
        self.sched = sched or Scheduler()
        # built on the loop's thread, whose load-time warm-up decode is then its first: a
        # decode from a second thread starts a second team of ggml's OpenMP threads, and
        # with two teams on 2 cores every decode took twice as long (47 ms a token, not 22)
        if width == 1:  # the context as Model builds it, with n_seq sequences over n_ctx each
            self.base = self.sched.submit(
                Model, replace(params, n_ctx=params.n_ctx * n_seq), n_seq_max=n_seq).result()
            self.n_ctx_seq = self.base.n_ctx_seq
        else:  # one unified cache (a tree's branches share cells): n_ctx a slot, and the
            # cells a tree may add beyond its slot's committed tokens
            self.base = self.sched.submit(
                Model, replace(params, n_ctx=(params.n_ctx + tree_cells) * n_seq),
                n_seq_max=n_seq * width, tree=True).result()
            self.n_ctx_seq = params.n_ctx
        self.pending: list[_Request] = []  # queued, in order
        self._hidden: set[Model] = set()  # slots whose draft reads hidden states (set_hidden)
        self._exports: dict[Model, tuple[tuple[int, ...], bool]] = {}  # slots' heads' reads
        self.closed = False
        # `first`: its decodes go ahead of the others' (the draft's)
        self.sched.contexts.insert(0 if first else len(self.sched.contexts), self)

    def view(self, seq: int) -> Model:
        """Slot seq's sequence (its tree branches after it), a Model whose decodes and edits
        run here."""
        return Model(self.params, share=self.base, seq=seq * self.width, runner=self,
                     n_branch=self.width, n_ctx=self.n_ctx_seq)

    # -- Runner (backend.model): what a slot's Model asks of the shared context -----------
    def run(self, m: Model, tokens: Sequence[int], pos0: int, n_out: int,
            nodes: tuple[list[int], list[list[int]]] | None = None) -> Ran:
        if not self.sched.on_thread():  # (a caller outside the loop: a task of its own)
            return self.sched.submit(self.run, m, tokens, pos0, n_out, nodes).result()
        if self.closed:
            raise BackendError("the model's context is closed (the server is stopping)")
        req = _Request(m.seq, list(tokens), pos0, n_out, nodes=nodes, hidden_of=m,
                       waiter=greenlet.getcurrent())
        req.prompt = self._chunkable(req)
        self.pending.append(req)
        self.sched.park()  # until the loop has decoded it (a long prompt: every chunk)
        if req.error is not None:
            raise req.error
        rows = req.rows if n_out else np.empty((0, m.n_vocab), dtype=np.float32)
        return Ran(rows, req.hidden, req.seconds, 1, req.layers, req.nextn)

    @contextmanager
    def editing(self):
        """llama.cpp contexts are not thread-safe: the cache is edited between decodes (a
        task on the loop is between decodes whenever it runs)."""
        if self.sched.on_thread():
            yield not self.closed
            return
        with self.sched.lock:
            yield not self.closed

    def keep_hidden(self, m: Model, on: bool) -> None:
        """The context keeps hidden states while any of its slots reads them."""
        with self.editing() as live:
            if on != (m in self._hidden):
                if on:
                    self._hidden.add(m)
                else:
                    self._hidden.discard(m)
                if live:
                    self.base.keep_hidden(self.base, bool(self._hidden))

    def keep_exports(self, m: Model, layers: tuple[int, ...], nextn: bool) -> None:
        """The context exports what any of its slots' heads reads."""
        with self.editing() as live:
            if layers or nextn:
                self._exports[m] = (layers, nextn)
            else:
                self._exports.pop(m, None)
            if live:
                self.base.keep_exports(self.base, *self._union())

    def _union(self) -> tuple[tuple[int, ...], bool]:
        layers = tuple(sorted({lid for ls, _ in self._exports.values() for lid in ls}))
        return layers, any(n for _, n in self._exports.values())

    def _export(self, batch: list[_Request], n_tokens: int) -> None:
        """Each request's share of what the last decode (n_tokens, the batch's tokens in
        order) exported, for the slots that read it."""
        if not any(r.hidden_of in self._exports for r in batch):
            return
        layers, nextn = self.base.read_exports(n_tokens, *self._union())
        off = 0
        for r in batch:
            n = r.take
            if r.hidden_of in self._exports:
                mine, wants = self._exports[r.hidden_of]
                r.layers = {lid: layers[lid][off:off + n] for lid in mine} if mine else None
                r.nextn = nextn[off:off + n] if wants else None
            off += n

    def close(self) -> None:
        """Later decodes are refused, and those queued fail; the loop ends with its last
        context. A second call does nothing."""
        if self.closed:
            return
        self.sched.submit(self._close).result()
        with self.editing():  # (never under a decode)
            self.base.close()
        if not self.sched.contexts and not self.sched.on_thread():
            self.sched._thread.join()

    def _close(self) -> None:
        self.closed = True
        self.step()  # the queued requests fail
        self.sched.remove(self)

    def has_steps(self) -> bool:
        """Whether a slot's step is queued here (not only prompts)."""
        return any(not r.prompt for r in self.pending)

    def step(self) -> None:
        """On the loop: decode what is queued (every slot's step, then as much of the queued
        prompts as a chunk takes), hand each request its rows and wake its task; a prompt
        not yet whole stays first in the queue."""
        if self.closed:
            batch, self.pending = self.pending, []
            for r in batch:
                r.error = BackendError("the model's context is closed (the server is stopping)")
        else:
            batch = self._next_batch()
            try:
                with self.sched.lock:
                    self._run(batch)
            except BaseException as e:  # noqa: BLE001 - handed to every caller
                for r in batch:
                    r.error = r.error or e
        back = [r for r in batch if r.error is None and r.done_n < len(r.tokens)]
        self.pending[:0] = back
        for r in batch:
            if r in back:
                continue
            if r.rows is None and r.error is None:
                r.error = BackendError("a decode did not complete")
            self.sched.wake(r.waiter)

    def _next_batch(self) -> list[_Request]:
        """The queued requests one decode takes: every step that fits n_batch (the first
        even if it does not: it is decoded alone, in chunks of n_batch), then the queued long
        prompts, shortest first, up to `chunk` of their tokens in all (llama-server's prompt
        processing inside its iterations: a long prompt does not hold up the other slots'
        generation, nor a short prompt, for the whole of its evaluation)."""
        batch, size, prompts = [], 0, []
        for r in self.pending:
            rest = len(r.tokens) - r.done_n
            if r.prompt:
                prompts.append(r)
            elif not batch or size + rest <= self.base.n_batch:
                r.take = rest
                batch.append(r)
                size += rest
        room = min(self.chunk, self.base.n_batch - size)
        for r in sorted(prompts, key=lambda r: len(r.tokens) - r.done_n):  # the shortest
            # first: a short request's prompt does not wait behind a long one's chunks
            if room <= 0 and batch:
                break
            r.take = min(len(r.tokens) - r.done_n, max(room, 1))
            batch.append(r)
            room -= r.take
        for r in batch:
            self.pending.remove(r)
        return batch

    def _chunkable(self, r: _Request) -> bool:
        """A prompt longer than a chunk whose slot reads only its last row (no tree, no
        hidden states, no exports: those want every token's at once). Anything shorter is
        a step: decoded whole with the others (a draft catching up on what was accepted, a
        short prompt), and the target's verifications wait for the drafts' steps, not for a
        long prompt's chunks (Scheduler._pick)."""
        return (r.nodes is None and r.n_out <= 1 and len(r.tokens) > self.chunk
                and r.hidden_of not in self._hidden and r.hidden_of not in self._exports)

    def _run(self, batch: list[_Request]) -> None:
        m = self.base
        if len(batch) == 1 or sum(r.take for r in batch) > m.n_batch:
            for r in batch:  # alone (a long step is decoded in chunks of n_batch)
                self.n_decodes += 1
                self.n_seq_decodes += 1
                try:
                    if r.nodes is not None or r.take < len(r.tokens):
                        dt = m.decode_items(r.items())
                    else:
                        dt, _ = m.decode_chunked(r.tokens, r.pos0, r.seq, r.n_out)
                    r.seconds += dt
                    if (self.timed and r.n_out == r.take and not r.prompt
                            and r.take <= m.n_batch):  # (not a step in chunks)
                        self.timed(r.take, dt)
                    n_now = r.n_now
                    if n_now or r.done_n + r.take == len(r.tokens):  # (its last piece)
                        r.rows = np.array(m.rows(n_now))  # a copy: see below
                        if r.hidden_of in self._hidden:
                            r.hidden = np.array(m.hidden_rows(n_now))
                    self._export([r], min(r.take, m.n_batch))
                    r.done_n += r.take
                except BackendError as e:
                    r.error = e
            return
        # in the order of their sequences: with a cache of one stream a sequence, llama.cpp
        # puts in one ubatch only sequences that follow each other (split_equal, sequential),
        # so 8 slots in arrival order made up to 8 graph runs of one token (119 ms, not 47)
        batch = sorted(batch, key=lambda r: r.seq)
        self.n_decodes += 1
        self.n_seq_decodes += len({r.seq for r in batch})
        try:
            dt = m.decode_items([item for r in batch for item in r.items()])
        except BackendError as e:
            for r in batch:
                r.error = e
            return
        if (self.timed and len({r.take for r in batch}) == 1 and not batch[0].prompt
                and all(r.n_out == r.take for r in batch)
                and batch[-1].seq - batch[0].seq == len(batch) - 1):  # steps of equal
            # lengths of sequences that follow each other only: a prompt's hundreds of
            # tokens would decide the fit, and unequal lengths or a gap between sequence
            # ids cost llama.cpp a graph run more (4 slots of ids 0, 1, 4, 6: three);
            # steps only, every row wanted (a plain step, a verification): a short prompt
            # (one row) alone once made the line's slope negative, and a draft's catch-up
            # (no rows) is timed by the plan apart
            self.timed(sum(r.take for r in batch), dt)
        n_now = [r.n_now for r in batch]
        rows = m.rows(sum(n_now))
        hidden = m.hidden_rows(rows.shape[0]) if self._hidden else None
        try:
            self._export(batch, sum(r.take for r in batch))
        except BackendError as e:
            for r in batch:
                r.error = e
            return
        off = 0
        for r, n in zip(batch, n_now, strict=True):
            r.done_n += r.take
            if n or r.done_n == len(r.tokens):  # (its last piece)
                # a copy: the next decode, maybe another slot's, reuses llama.cpp's logits
                # buffer before this slot has read its rows
                r.rows = np.array(rows[off:off + n])
                if hidden is not None and r.hidden_of in self._hidden:
                    r.hidden = np.array(hidden[off:off + n])
            off += n
            r.seconds += dt


@dataclass
class _Request:
    """One slot's decode, queued at a SharedContext until the loop runs it."""

    seq: int
    tokens: Sequence[int]
    pos0: int
    n_out: int
    rows: np.ndarray | None = None
    error: Exception | None = None
    seconds: float = 0.0
    hidden: np.ndarray | None = None  # the rows' hidden states, when its slot reads them
    layers: dict[int, np.ndarray] | None = None  # its tokens' exported layer inputs
    nextn: np.ndarray | None = None  # its tokens' next-token-head states
    hidden_of: Model | None = None  # the slot's Model
    nodes: tuple[Sequence[int], Sequence[Sequence[int]]] | None = None  # a tree: pos, seqs
    waiter: greenlet.greenlet | None = None  # the slot's task, woken once it is decoded
    prompt: bool = False  # a prompt, decoded in chunks (SharedContext._chunkable)
    done_n: int = 0  # its tokens already decoded (a prompt in chunks)
    take: int = 0  # its tokens in the batch being decoded

    @property
    def n_now(self) -> int:
        """The rows the batch being decoded gives it (its last n_out tokens' that it holds;
        read before done_n moves past the batch)."""
        hi = self.done_n + self.take if self.nodes is None else len(self.tokens)
        return max(0, hi - max(self.done_n, len(self.tokens) - self.n_out))

    def items(self) -> list[tuple[int, int, Sequence[int], bool]]:
        """Its tokens in the batch being decoded, as backend.Model.decode_items takes them."""
        if self.nodes is not None:
            pos, seqs = self.nodes
            return [(t, p, ss, True) for t, p, ss in zip(self.tokens, pos, seqs, strict=True)]
        first_out = len(self.tokens) - self.n_out
        return [(self.tokens[i], self.pos0 + i, (self.seq,), i >= first_out)
                for i in range(self.done_n, self.done_n + self.take)]
