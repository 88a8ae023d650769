"""Test work run at once: on threads (clients of one server), or as tasks of a server's loop
(slots sampling together)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any


def at_once(work: Callable[[int], Any], n: int, timeout: float = 600,
            keep_errors: bool = False) -> list:
    """work(0) .. work(n - 1), each on a thread of its own, released together; their results
    in order. An exception one raised is raised here once all have ended, or with
    keep_errors stands in its place among the results."""
    out: list = [None] * n
    start = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            start.wait()
            out[i] = work(i)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"work still running after {timeout:g} s")
    errors = [x for x in out if isinstance(x, BaseException)]
    if errors and not keep_errors:
        raise errors[0]
    return out


def as_tasks(sched, work: Callable[[int], Any], n: int, timeout: float = 600,
             keep_errors: bool = False) -> list:
    """work(0) .. work(n - 1) as tasks of a server's loop (batching.Scheduler), started in
    the same iteration, as the server's slots run: their decodes are combined, in an order
    that depends on nothing but the work. Results as at_once's."""
    futs = sched.submit_all([functools.partial(work, i) for i in range(n)])
    done, left = futures.wait(futs, timeout)
    if left:
        raise TimeoutError(f"work still running after {timeout:g} s")
    out = [f.exception() or f.result() for f in futs]
    errors = [x for x in out if isinstance(x, BaseException)]
    if errors and not keep_errors:
        raise errors[0]
    return out
