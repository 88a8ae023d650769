"""Helper processes: a job that no deadline or memory limit can bound inside this process
(llama.cpp's grammar engine in C, one call into a Jinja filter) runs in a child of its own,
`python -P -m specli.MODULE ...`, spoken to over a socket pair; a child over its deadline
is killed and the next call starts a fresh one (grammar_host.py, template_host.py).

`Child` starts, waits for and ends one; `Pool` hands out a few of them to the callers that
wait for one; `limit_memory` and `watch_parent` are the child's own first steps.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Generic, TypeVar

from specli.errors import BackendError, UsageError


class Busy(UsageError):
    """Every host of a pool stayed busy (with work that runs to its deadline): a 503."""


class Child:
    """One child process: `python -P -m module <fd> args...`, its end of the socket pair
    passed as fd (-P: nothing from the working directory is imported). It says b"ready"
    once it can take requests. Its stdout and stderr go to /dev/null (a pipe nobody reads
    would fill and stop it)."""

    def __init__(self, module: str, args: Sequence[str], what: str,
                 env: dict[str, str] | None = None):
        self.module, self.args, self.what, self.env = module, list(args), what, env
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.ready = False

    def start(self) -> None:
        """Start it, without waiting for its ready (its imports overlap the caller's work)."""
        if self.proc is not None:
            return
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", self.module, str(theirs.fileno()), *self.args],
                pass_fds=(theirs.fileno(),), env=self.env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as e:
            mine.close()
            raise BackendError(f"the {self.what} process could not start: {e}") from None
        finally:
            theirs.close()
        self.conn, self.ready = Connection(mine.detach()), False

    def wait_ready(self, timeout: float = 120) -> None:
        """Started and ready, or BackendError (and it is gone)."""
        self.start()
        if self.ready:
            return
        try:
            ok = self.conn.poll(timeout) and self.conn.recv_bytes() == b"ready"
        except (OSError, EOFError):
            ok = False
        if not ok:
            how = self.stop(kill=True)
            raise BackendError(f"the {self.what} process did not start: {how or 'no answer'}")
        self.ready = True

    def stop(self, kill: bool = False) -> str:
        """End it (killed: over its deadline); how it ended, if it died."""
        proc, conn, self.proc, self.conn, self.ready = self.proc, self.conn, None, None, False
        if conn is not None:
            conn.close()  # a live child reads EOF and exits
        if proc is None:
            return ""
        if kill:
            proc.kill()
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if code is not None and code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit {code}" if code else ""

    def kill(self) -> None:
        """Kill it now, without waiting for a call in flight (which then fails): for a
        server that is stopping."""
        proc = self.proc
        if proc is not None:
            proc.kill()


H = TypeVar("H")


class Pool(Generic[H]):
    """A few hosts for callers that each need one for a while: one that runs to its deadline
    holds one host, not every caller behind it; a caller that finds none free within
    `wait_s` gets busy(wait_s) raised."""

    def __init__(self, hosts: Sequence[H], busy: Callable[[float], Busy], wait_s: float):
        self.hosts, self._busy, self.wait_s = list(hosts), busy, wait_s
        self._free: list[H] = list(self.hosts)
        self._cond = threading.Condition()

    @contextmanager
    def one(self) -> Iterator[H]:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, self.wait_s):
                raise self._busy(self.wait_s)
            host = self._free.pop()
        try:
            yield host
        finally:
            with self._cond:
                self._free.append(host)
                self._cond.notify()

    def kill(self) -> None:
        for h in self.hosts:
            h.kill()

    def close(self) -> None:
        for h in self.hosts:
            h.close()


# -- in the child ------------------------------------------------------------------------------

def limit_memory(extra: int) -> None:
    """RLIMIT_AS at what the child holds now, and `extra` bytes more."""
    import resource

    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, size + extra))


def watch_parent() -> None:
    """End this child once its parent is gone, even in the middle of C code (the GIL is
    released there, or a filter's loop lets this thread run). Not PR_SET_PDEATHSIG: it
    fires when the parent's *thread* that started the child ends, and a server starts
    children from threads that come and go."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
