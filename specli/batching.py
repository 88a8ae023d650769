"""Batching for a server's slots: several sequences of one llama_context, whose decodes
are combined into one llama_decode, as llama-server does. A scheduler over backend.Model's
public decode API; it holds no llama.cpp handle of its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

from specli.backend.model import Model, Ran
from specli.config import ModelParams
from specli.errors import BackendError


class Gate:
    """The slots generating right now, and how many of them wait at a SharedContext. A decode
    starts once no running slot can still join it: every running slot is parked at one of
    the contexts (its tokens already queued), so batches are as large as they can be without
    a timing guess. One Gate serves a pool's target and draft contexts."""

    MAX_WAIT = 0.05  # seconds: a safety net, should a running slot stall outside a decode

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.running = 0
        self.parked = 0
        self.contexts: list[SharedContext] = []
        # every decode runs on this one thread: ggml's OpenMP keeps a team of spinning threads
        # per calling thread, and decodes from the slots' rotating threads ran 25% slower
        self.decoder = ThreadPoolExecutor(1, thread_name_prefix="specli-decode")

    def remove(self, ctx: SharedContext) -> None:
        with self.cond:
            self.contexts.remove(ctx)
            if not self.contexts:  # waiting under cond is safe: a decode never takes it
                self.decoder.shutdown()

    def enter(self) -> None:
        with self.cond:
            self.running += 1

    def leave(self) -> None:
        with self.cond:
            self.running -= 1
            self.cond.notify_all()

    def busy(self, ctx: SharedContext) -> bool:
        """Another context is decoding: wait for it before gathering, as its slots may come
        here next (the decode thread runs one llama_decode at a time anyway)."""
        return any(c.decoding for c in self.contexts if c is not ctx)

    def gather(self, ctx: SharedContext) -> bool:
        """Whether a decode at ctx should wait for more slots to join: while a running slot
        is still in Python (it may come here), or, when every running slot is parked, while
        a context ahead of ctx (the draft's) holds slots: they draft first, so that every
        slot arrives at the verification together, and slots fall into step, as in
        llama-server's one loop (draft everyone, then verify everyone in one batch)."""
        if ctx.inside >= self.running:
            return False
        if self.parked < self.running:
            return True
        # (a prompt in chunks there is no step to wait for: the others verify meanwhile)
        return any(c.inside - c.prompts for c in self.contexts[:self.contexts.index(ctx)])


class SharedContext:
    """One llama_context holding several sequences (server slots), as llama-server does.

    Each slot decodes through its own SeqModel from its own thread; decodes that arrive
    together are combined into one llama_decode (a batch of several sequences costs much less
    than as many single decodes on this CPU, and more so on a GPU). The first caller leads:
    it waits (Gate) until every other running slot is parked at a context, decodes everyone's
    tokens queued here at once, and hands each caller a copy of its own logits rows."""

    def __init__(self, params: ModelParams, n_seq: int, gate: Gate | None = None,
                 first: bool = False, width: int = 1, tree_cells: int = 0,
                 timed: Callable[[int, float], None] | None = None):
        self.params = params
        # told each step decode's tokens in all and its seconds (--draft auto's batch cost)
        self.timed = timed
        self.chunk = min(params.n_ubatch, params.n_batch)  # prompt tokens in one decode
        self.n_seq = n_seq
        self.width = width  # draft-tree branches per slot: sequences seq*width.. of each
        self.gate = gate or Gate()
        # built on the decode thread, whose load-time warm-up decode is then its first: a
        # decode from a second thread starts a second team of ggml's OpenMP threads, and
        # with two teams on 2 cores every decode took twice as long (47 ms a token, not 22)
        if width == 1:  # the context as Model builds it, with n_seq sequences over n_ctx each
            self.base = self.gate.decoder.submit(
                Model, replace(params, n_ctx=params.n_ctx * n_seq), n_seq_max=n_seq).result()
            self.n_ctx_seq = self.base.n_ctx_seq
        else:  # one unified cache (a tree's branches share cells): n_ctx a slot, and the
            # cells a tree may add beyond its slot's committed tokens
            self.base = self.gate.decoder.submit(
                Model, replace(params, n_ctx=(params.n_ctx + tree_cells) * n_seq),
                n_seq_max=n_seq * width, tree=True).result()
            self.n_ctx_seq = params.n_ctx
        self._pending: list[_Request] = []
        self._hidden: set[Model] = set()  # slots whose draft reads hidden states (set_hidden)
        self._exports: dict[Model, tuple[tuple[int, ...], bool]] = {}  # slots' heads' reads
        self._leading = False
        self.inside = 0  # slots parked here: queued, or in the batch being decoded
        self.prompts = 0  # of them, prompts (decoded in chunks)
        self.decoding = False
        self.closed = False
        # `first`: its decodes go ahead of the others' when all slots wait (the draft's)
        self.gate.contexts.insert(0 if first else len(self.gate.contexts), self)

    def view(self, seq: int) -> Model:
        """Slot seq's sequence (its tree branches after it), a Model whose decodes and edits
        run here."""
        return Model(self.params, share=self.base, seq=seq * self.width, runner=self,
                     n_branch=self.width, n_ctx=self.n_ctx_seq)

    # -- Runner (backend.model): what a slot's Model asks of the shared context -----------
    def run(self, m: Model, tokens: Sequence[int], pos0: int, n_out: int,
            nodes: tuple[list[int], list[list[int]]] | None = None) -> Ran:
        req = _Request(m.seq, list(tokens), pos0, n_out, nodes=nodes, hidden_of=m)  # queued
        self.decode(req)
        if req.error is not None:
            raise req.error
        rows = req.rows if n_out else np.empty((0, m.n_vocab), dtype=np.float32)
        return Ran(rows, req.hidden, req.seconds, 1, req.layers, req.nextn)

    @contextmanager
    def editing(self):
        """llama.cpp contexts are not thread-safe: a slot edits the cache between decodes."""
        g = self.gate
        with g.cond:
            while self.decoding:
                g.cond.wait()
            yield not self.closed

    @contextmanager
    def generation(self):
        """A slot generating: decodes wait for it to join them (Gate.gather)."""
        self.gate.enter()
        try:
            yield
        finally:
            self.gate.leave()

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
        with self.gate.cond:  # never under a decode; later decodes are refused
            while self.decoding:
                self.gate.cond.wait()
            self.closed = True
        if self in self.gate.contexts:
            self.gate.remove(self)
        self.base.close()

    def decode(self, req: _Request) -> None:
        g = self.gate
        with g.cond:
            if self.closed:
                raise BackendError("the model's context is closed (the server is stopping)")
            self._pending.append(req)
            g.parked += 1
            self.inside += 1
            req.prompt = self._chunkable(req)
            self.prompts += req.prompt
            g.cond.notify_all()
            try:
                while not req.done:  # a prompt in chunks may need several batches
                    while not req.done and self._leading:
                        g.cond.wait()
                    if not req.done:
                        self._lead(req)
            finally:
                self._unpark(req)
                g.cond.notify_all()

    def _lead(self, req: _Request) -> None:
        """Under the gate's lock: wait until nobody else can still join, decode what is
        queued (every slot's step, then as much of the queued prompts as a chunk takes), and
        hand each request its rows; a prompt not yet whole goes back to the queue."""
        g = self.gate
        self._leading = True
        deadline = None
        while True:
            if g.busy(self):
                g.cond.wait()
                continue
            if deadline is None:  # counted from when the other context is free
                deadline = time.perf_counter() + g.MAX_WAIT
            left = deadline - time.perf_counter()
            if left <= 0 or not g.gather(self):
                break
            g.cond.wait(left)
        batch = self._next_batch(req)
        self.decoding = True
        g.cond.release()  # decode without the lock: others may queue meanwhile
        try:
            g.decoder.submit(self._run, batch).result()
        except BaseException as e:  # noqa: BLE001 - handed to every caller
            for r in batch:
                r.error = r.error or e
        finally:
            g.cond.acquire()
            back = [r for r in batch if r.error is None and r.done_n < len(r.tokens)]
            self._pending[:0] = back  # first in the queue again, still parked
            for r in batch:
                if r in back:
                    continue
                if r.rows is None and r.error is None:
                    r.error = BackendError("a decode did not complete")
                r.done = True
                self._unpark(r)  # now, not when its thread wakes: the next leader
                # waits for it to queue again rather than decode without it
            self._leading = self.decoding = False
            g.cond.notify_all()

    def _next_batch(self, req: _Request) -> list[_Request]:
        """The queued requests one decode takes: every step that fits n_batch (req's even if
        it does not: it is decoded alone, in chunks of n_batch), then the queued long
        prompts, shortest first, up to `chunk` of their tokens in all (llama-server's prompt
        processing inside its iterations: a long prompt does not hold up the other slots'
        generation, nor a short prompt, for the whole of its evaluation)."""
        batch, size, prompts = [], 0, []
        for r in self._pending:
            rest = len(r.tokens) - r.done_n
            if r.prompt:
                prompts.append(r)
            elif r is req or size + rest <= self.base.n_batch:
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
            self._pending.remove(r)
        return batch

    def _chunkable(self, r: _Request) -> bool:
        """A prompt longer than a chunk whose slot reads only its last row (no tree, no
        hidden states, no exports: those want every token's at once). Anything shorter is
        a step: decoded whole with the others (a draft catching up on what was accepted, a
        short prompt), and the target's verifications wait for the drafts' steps, not for a
        long prompt's chunks (Gate.gather)."""
        return (r.nodes is None and r.n_out <= 1 and len(r.tokens) > self.chunk
                and r.hidden_of not in self._hidden and r.hidden_of not in self._exports)

    def _unpark(self, r: _Request) -> None:
        """r no longer waits here (once: by its batch's end, or by its thread)."""
        if r.parked:
            r.parked = False
            self.gate.parked -= 1
            self.inside -= 1
            self.prompts -= r.prompt

    def _run(self, batch: list[_Request]) -> None:
        m = self.base
        if len(batch) == 1 or sum(r.take for r in batch) > m.n_batch:
            for r in batch:  # alone (a long step is decoded in chunks of n_batch)
                try:
                    if r.nodes is not None or r.take < len(r.tokens):
                        dt = m.decode_items(r.items())
                    else:
                        dt, _ = m.decode_chunked(r.tokens, r.pos0, r.seq, r.n_out)
                    r.seconds += dt
                    if self.timed and not r.prompt and r.take <= m.n_batch:
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
        try:
            dt = m.decode_items([item for r in batch for item in r.items()])
        except BackendError as e:
            for r in batch:
                r.error = e
            return
        if self.timed and not any(r.prompt for r in batch):  # steps only: a
            # prompt's hundreds of tokens would decide the line through batches of a few
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
    """One slot's decode, queued at a SharedContext until a leader runs it."""

    seq: int
    tokens: Sequence[int]
    pos0: int
    n_out: int
    done: bool = False
    rows: np.ndarray | None = None
    error: Exception | None = None
    seconds: float = 0.0
    hidden: np.ndarray | None = None  # the rows' hidden states, when its slot reads them
    layers: dict[int, np.ndarray] | None = None  # its tokens' exported layer inputs
    nextn: np.ndarray | None = None  # its tokens' next-token-head states
    hidden_of: Model | None = None  # the slot's Model
    nodes: tuple[Sequence[int], Sequence[Sequence[int]]] | None = None  # a tree: pos, seqs
    parked: bool = True  # counted in its gate's parked slots and its context's inside
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
