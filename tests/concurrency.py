"""Test work run at once on threads: server slots sampling together, clients of one server."""

from __future__ import annotations

import threading
from collections.abc import Callable
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
