"""Grammars in a process of their own, bounded in time and memory (the server's).

llama.cpp's grammar engine has no bound of its own. Ambiguous repetition (`x{0,60}` inside
`y{0,60}` inside `root ::= y{0,60}`, 46 bytes) multiplies its parse stacks until one test of
which token may come next takes minutes, in C, where no thread can be interrupted; and
llama-cpp-python's JSON-schema converter spells `minLength: 1000000000` out in full. So a
server runs every conversion, parse and test of a client's grammar in a child process that
holds only the vocabulary: each call answers within a deadline or the child is killed, and it
lives under a memory limit (RLIMIT_AS). A killed child takes only its own grammars with it;
the next call starts a fresh one.

`GrammarHost.check` is what a request passes before it takes a slot: the schema converted, the
grammar parsed and walked a few tokens. `GrammarHost.open` gives the generation a grammar
whose `allowed`/`accept`/`fork`/`close` are those of backend.Grammar, each a call into the
child. The child speaks bytes, not pickle: what a grammar could make of it never runs here.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from multiprocessing.connection import Connection

import numpy as np

from specli import child
from specli.child import Child, Pool, limit_memory, watch_parent
from specli.errors import BackendError, UsageError

STEP_S = 2.0  # one test, accept or fork during a generation
# a generation's grammar time, all its tests together: BASE_S, and PER_TOKEN_S more for each
# token accepted (a grammar that costs seconds a token, each test under STEP_S, is stopped too)
BASE_S, PER_TOKEN_S = 5.0, 0.5
WAIT_S = 10.0  # for a free checker, before a 503
CHECK_S = 5.0  # a request's conversion, parse and first steps, before it takes a slot
MEMORY = 1 << 30  # bytes a child may take beyond what it holds once the vocabulary is in
MAX_GBNF = 1 << 20  # characters of grammar, given or converted from a schema
PROBE_IDS = 256  # token ids tested at each step of the check
PROBE_STEPS = 8  # tokens the check walks into the grammar


class GrammarError(UsageError):
    """A grammar or JSON schema the server will not run: too large, too slow or too
    memory-hungry to test (a 400), or invalid."""


class GrammarHost:
    """One child process holding grammars over one model's vocabulary. Thread-safe (a lock
    per call); a server gives each slot its own, and one more for the checks."""

    def __init__(self, model_path: str, step_s: float = STEP_S, memory: int = MEMORY):
        self.path, self.step_s, self.memory = model_path, step_s, memory
        self._lock = threading.RLock()  # check() holds it across its calls
        # no device: a vocabulary needs none, and each child would otherwise open a GPU
        # context (stderr goes nowhere: llama.cpp prints a refused grammar there whole)
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
               "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "",
               "GGML_VK_VISIBLE_DEVICES": "", "ONEAPI_DEVICE_SELECTOR": "opencl:cpu"}
        self._child = Child("specli.grammar_host", [model_path, str(memory)], "grammar", env)
        self.epoch = 0  # bumped when a child is killed: its grammars are gone with it
        self.killed = 0  # children killed over a deadline or their memory (tests, logs)
        self._dropped: list[tuple[int, int]] = []  # (epoch, handle) left to the collector

    # -- the child ---------------------------------------------------------------------------
    @property
    def _proc(self):
        return self._child.proc

    @property
    def _conn(self):
        return self._child.conn

    def _start(self) -> None:
        self._child.wait_ready()

    def _stop(self, kill: bool = False) -> str:
        """End the child (killed: over its deadline); how it ended, if it died."""
        return self._child.stop(kill)

    def close(self) -> None:
        with self._lock:
            self._stop()

    def kill(self) -> None:
        """Kill the child now, without waiting for a call in flight (which then fails): for a
        server that is stopping."""
        self._child.kill()

    def _call(self, op: bytes, handle: int, payload: bytes, timeout: float,
              epoch: int | None = None, what: str = "", limit: float | None = None) -> bytes:
        """One request to the child and its answer within `timeout` seconds; over it, the
        child is killed and GrammarError says what took too long."""
        with self._lock:
            if epoch is not None and epoch != self.epoch:
                if op == b"X":
                    return b""
                raise GrammarError("the grammar was stopped (its process was restarted)")
            if self._proc is None:
                if op == b"X":
                    return b""
                self._start()
            conn = self._conn
            try:
                while self._dropped:  # grammars the garbage collector let go of
                    e, h = self._dropped.pop()
                    if e == self.epoch:
                        conn.send_bytes(b"X" + h.to_bytes(4, "little"))
                conn.send_bytes(op + handle.to_bytes(4, "little") + payload)
                if op == b"X":  # closing a grammar needs no answer
                    return b""
                ready = conn.poll(timeout)
                reply = conn.recv_bytes() if ready else None
            except (OSError, EOFError):
                reply, ready = None, True
            if reply is None:  # over the deadline, or the child died (memory: an abort)
                code = self._proc.poll() if self._proc is not None else None
                err = self._stop(kill=not ready)
                self.killed += 1
                self.epoch += 1
                if not ready:
                    raise GrammarError(f"the grammar took over {limit or timeout:.3g} s to "
                                       f"{what} and was stopped: it is too ambiguous to run "
                                       "(nested optional repetitions multiply its parse "
                                       "states)",
                                       hint="simplify the grammar or the JSON schema")
                raise GrammarError(f"the grammar needed more than the server allows to "
                                   f"{what} (over {self.memory >> 20} MiB of memory, or it "
                                   f"crashed: {err or f'exit {code}'}) and was stopped",
                                   hint="simplify the grammar or the JSON schema")
        if reply[:1] == b"E":
            raise GrammarError(reply[1:].decode("utf-8", "replace"),
                               hint="see llama.cpp's grammars/README.md")
        return reply[1:]

    # -- what a request needs ----------------------------------------------------------------
    def check(self, grammar: str | None = None, schema: dict | None = None,
              budget: float = CHECK_S, tools: tuple[dict, str] | None = None) -> str:
        """The request's GBNF (its grammar, or its schema converted, or its tools' schemas
        converted under their rule names with a root over them: toolcall.grammar_parts),
        once parsed and walked PROBE_STEPS tokens into within `budget` seconds (counted from
        when this host is free: a check queued behind another keeps its whole budget);
        GrammarError otherwise."""
        with self._lock:
            return self._check(grammar, schema, budget, tools)

    def _check(self, grammar: str | None, schema: dict | None, budget: float,
               tools: tuple[dict, str] | None = None) -> str:
        if self._proc is None:
            self._start()  # a start is not the grammar's time
        deadline = time.monotonic() + budget

        def left() -> float:
            return max(deadline - time.monotonic(), 0.05)

        if schema is not None or tools is not None:
            raw = json.dumps(schema if tools is None else list(tools))
            if len(raw) > MAX_GBNF:
                raise GrammarError(f"the JSON schema is {len(raw)} characters, over the "
                                   f"server's limit of {MAX_GBNF}")
            grammar = self._call(b"S" if tools is None else b"T", 0, raw.encode(), left(),
                                 what="convert the JSON schema", limit=budget).decode()
        if grammar is None or not grammar:
            return grammar or ""
        if len(grammar) > MAX_GBNF:
            raise GrammarError(f"the grammar is {len(grammar)} characters, over the "
                               f"server's limit of {MAX_GBNF}")
        h = int.from_bytes(self._call(b"O", 0, grammar.encode(), left(), what="parse",
                                      limit=budget), "little")
        try:
            self._call(b"P", h, PROBE_STEPS.to_bytes(4, "little"), left(),
                       what="test its first tokens", limit=budget)
        finally:
            self._call(b"X", h, b"", 0)
        return grammar

    def open(self, gbnf: str) -> RemoteGrammar:
        with self._lock:
            if self._proc is None:
                self._start()
            budget = Budget()
            h = int.from_bytes(budget.call(self, b"O", 0, gbnf.encode(), None, "parse"),
                               "little")
            return RemoteGrammar(self, h, self.epoch, budget)


class Budget:
    """The grammar time of one generation (a grammar and its forks): BASE_S, and PER_TOKEN_S
    more for each token accepted; every call's deadline is STEP_S or what is left, if less."""

    def __init__(self):
        self.spent, self.tokens = 0.0, 0

    def left(self) -> float:
        return BASE_S + PER_TOKEN_S * self.tokens - self.spent

    def call(self, host: GrammarHost, op: bytes, handle: int, payload: bytes,
             epoch: int | None, what: str) -> bytes:
        left = self.left()
        if left <= 0:
            raise GrammarError(f"the grammar used {self.spent:.1f} s of the server's time for "
                               f"{self.tokens} tokens and was stopped: it is too slow to run",
                               hint="simplify the grammar or the JSON schema")
        t0 = time.monotonic()
        try:
            return host._call(op, handle, payload, min(host.step_s, max(left, 0.05)), epoch,
                              what)
        finally:
            self.spent += time.monotonic() - t0
            if op == b"C":
                self.tokens += 1


class Busy(GrammarError, child.Busy):
    """Every checker is busy (with grammars that run to their deadline): a 503."""


class Checkers(Pool["GrammarHost"]):
    """A few GrammarHosts for the checks requests pass before they take a slot: a check that
    runs to its deadline holds one, not every request's grammar behind it; a request that
    finds none free within WAIT_S is answered 503."""

    def __init__(self, model_path: str, n: int = 2):
        super().__init__([GrammarHost(model_path) for _ in range(n)], lambda s: Busy(
            f"every grammar checker stayed busy for {s:g} s", hint="try again"), WAIT_S)

    def check(self, grammar: str | None = None, schema: dict | None = None,
              tools: tuple[dict, str] | None = None) -> str:
        if not grammar and schema is None and tools is None:
            return grammar or ""
        with self.one() as host:
            return host.check(grammar, schema, tools=tools)


class RemoteGrammar:
    """backend.Grammar's interface, in a GrammarHost's child: each call within its deadline."""

    def __init__(self, host: GrammarHost, handle: int, epoch: int, budget: Budget):
        self._host, self._h, self._epoch, self._budget = host, handle, epoch, budget

    def _call(self, op: bytes, payload: bytes, what: str) -> bytes:
        if self._h is None:
            raise GrammarError("the grammar is closed")
        return self._budget.call(self._host, op, self._h, payload, self._epoch, what)

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        raw = self._call(b"A", np.ascontiguousarray(ids, dtype=np.int32).tobytes(),
                         "test the next token")
        return np.frombuffer(raw, dtype=np.bool_).copy()

    def accept(self, token: int) -> None:
        self._call(b"C", int(token).to_bytes(4, "little", signed=True), "accept a token")

    def fork(self) -> RemoteGrammar:
        h = int.from_bytes(self._call(b"F", b"", "copy its state"), "little")
        return RemoteGrammar(self._host, h, self._epoch, self._budget)

    def close(self) -> None:
        h, self._h = self._h, None
        if h is not None and self._epoch == self._host.epoch:
            try:
                self._host._call(b"X", h, b"", 0, self._epoch)
            except (GrammarError, BackendError):
                pass  # its process is gone, and the grammar with it

    def __del__(self) -> None:
        # not a call: the collector may run while this thread is inside one
        if self._h is not None:
            self._host._dropped.append((self._epoch, self._h))


# -- the child ---------------------------------------------------------------------------------

def _serve(fd: int, path: str, memory: int) -> None:
    watch_parent()
    from specli import backend

    conn = Connection(fd)
    tok = backend.Tokenizer(path)
    limit_memory(memory)
    probe = np.linspace(0, tok.n_vocab - 1, min(PROBE_IDS, tok.n_vocab)).astype(np.int32)
    grammars: dict[int, backend.Grammar] = {}
    ids = iter(range(1, 1 << 31))
    conn.send_bytes(b"ready")
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return
        op, h, payload = msg[:1], int.from_bytes(msg[1:5], "little"), msg[5:]
        try:
            if op == b"X":
                g = grammars.pop(h, None)
                if g is not None:
                    g.close()
                continue
            if op in (b"S", b"T"):
                out = (backend.schema_grammar(json.loads(payload)) if op == b"S" else
                       backend.schemas_grammar(*json.loads(payload))).encode()
                if len(out) > MAX_GBNF:
                    raise UsageError(f"the JSON schema converts to a grammar of {len(out)} "
                                     f"characters, over the server's limit of {MAX_GBNF}")
            elif op == b"O":
                n = next(ids)
                grammars[n] = backend.Grammar(tok, payload.decode())
                out = n.to_bytes(4, "little")
            elif op == b"A":
                mask = grammars[h].allowed(np.frombuffer(payload, dtype=np.int32))
                out = mask.astype(np.bool_).tobytes()
            elif op == b"C":
                g = grammars[h]
                token = int.from_bytes(payload, "little", signed=True)
                if not g.allowed(np.array([token], dtype=np.int32))[0]:
                    raise UsageError(f"token {token} is not allowed here")  # llama.cpp aborts
                g.accept(token)
                out = b""
            elif op == b"F":
                n = next(ids)
                grammars[n] = grammars[h].fork()
                out = n.to_bytes(4, "little")
            elif op == b"P":  # walk a few tokens in, the first allowed among the probe's
                g = grammars[h].fork()
                try:
                    for _ in range(int.from_bytes(payload, "little")):
                        ok = probe[g.allowed(probe)]
                        if not ok.size:  # none of the probe's: the whole vocabulary
                            every = np.arange(tok.n_vocab, dtype=np.int32)
                            ok = every[g.allowed(every)]
                        if not ok.size:
                            break
                        g.accept(int(ok[0]))
                finally:
                    g.close()
                out = b""
            else:
                raise UsageError(f"unknown request {op!r}")
            conn.send_bytes(b"K" + out)
        except (UsageError, KeyError, ValueError, MemoryError, RecursionError) as e:
            message = getattr(e, "message", None) or (
                f"the {'JSON schema' if op in (b'S', b'T') else 'grammar'} needs more than the "
                f"{memory >> 20} MiB of memory the server allows"
                if isinstance(e, MemoryError) else f"{type(e).__name__}: {e}")
            conn.send_bytes(b"E" + message.encode("utf-8", "replace"))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
