"""`-t auto`: the thread count measured, not assumed (issue 59).

ggml's threads spin at every barrier: on a machine with other work, one preempted thread
holds the others, and the CPU count llama.cpp defaults to ran 50x slower than one thread.
A `Threads` chooser times a context's decodes at each count that can win, keeps the
fastest, and looks again when the time a token drifts from what it measured (or, now and
then, in case the other work went away). Single-token decodes (llama.cpp's n_threads) and
batches (n_threads_batch: verification batches, prompt chunks) are chosen apart, since
llama.cpp uses one count for each. A prompt's large chunks (more than BATCH tokens) run at
the batches' choice, untimed: they are not the decodes the choice is for, and a look there
would run a long prompt at one thread.

Pure Python and a clock: the backend calls `before(n)` ahead of each llama_decode (which may
change the context's counts, llama_set_n_threads) and `after(n, seconds)` after it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

TRIALS = 4  # decodes a count is timed for, when the chooser looks (the first is dropped)
DRIFT = 1.5  # the time a token this much over what the choice measured: look again
SETTLE = 16  # decodes at a choice before a drift may count (a pause is no drift)
RECHECK = 400  # decodes at a choice before looking again anyway
BATCH = 64  # a decode of more tokens is a prompt's chunk
CLOSE = 0.05  # counts within this of the fastest: the fewest wins (fewer threads to preempt)


def candidates(cpus: int) -> tuple[int, ...]:
    """The counts that can win on `cpus` usable CPUs: 1, every power of two below, and all
    of them (at most 8, llama.cpp's own cap)."""
    top = max(1, min(cpus, 8))
    out, n = [], 1
    while n < top:
        out.append(n)
        n *= 2
    return (*out, top)


@dataclass
class _Class:
    """One kind of decode (single tokens, or batches): its choice and what it measured."""

    counts: tuple[int, ...]
    chosen: int
    trying: list[int] = field(default_factory=list)  # counts still to time, this look
    times: dict[int, list[float]] = field(default_factory=dict)  # per-token seconds
    measured: dict[int, float] = field(default_factory=dict)  # the last look's medians
    since: int = 0  # decodes at the choice
    recent: float = 0.0  # the time a token at the choice, decayed
    looks: int = 0
    why: str = "not measured yet"
    # the decode size a look times and the drift compares (a batch's time a token falls as
    # it grows: counts are compared at one size, the first the look meets)
    size: int | None = None
    settled: int = 0  # decodes of that size at the choice
    skipped: int = 0  # decodes of other sizes in a row during the look

    def look(self, why: str) -> None:
        self.trying, self.times, self.since, self.recent = list(self.counts), {}, 0, 0.0
        self.why, self.size, self.settled, self.skipped = why, None, 0, 0

    @property
    def current(self) -> int:
        return self.trying[0] if self.trying else self.chosen

    def timed(self, n_tokens: int, per_token: float) -> None:
        if self.size is None:
            self.size = n_tokens
        if self.trying:
            if n_tokens != self.size:  # another size: not comparable with this look's
                self.skipped += 1
                if self.skipped >= 2 * TRIALS:  # that size is gone: time this one instead
                    self.trying, self.times = list(self.counts), {}
                    self.size, self.skipped = n_tokens, 0
                return
            c, self.skipped = self.trying[0], 0
            got = self.times.setdefault(c, [])
            got.append(per_token)
            if len(got) >= TRIALS:
                self.trying.pop(0)
                if not self.trying:
                    self._choose()
            return
        self.since += 1
        if n_tokens == self.size:
            self.settled += 1
            self.recent = per_token if self.settled == 1 else \
                0.8 * self.recent + 0.2 * per_token
        best = self.measured.get(self.chosen)
        if best and self.settled >= SETTLE and self.recent > DRIFT * best:
            self.look(f"looked again: {1e3 * self.recent:.2f} ms a token against the "
                      f"{1e3 * best:.2f} measured")
        elif self.since >= RECHECK:
            self.look("looked again after a while")

    def _choose(self) -> None:
        self.measured = {c: statistics.median(t[1:] or t) for c, t in self.times.items()}
        best = min(self.measured.values())
        self.chosen = min(c for c, t in self.measured.items() if t <= best * (1 + CLOSE))
        self.looks += 1

    def describe(self) -> str:
        if not self.measured:
            return f"{self.chosen} (not measured: too few of these decodes)"
        ms = ", ".join(f"{c}: {1e3 * t:.2f}" for c, t in sorted(self.measured.items()))
        at = f" of {self.size}-token decodes" if self.size and self.size > 1 else ""
        return f"{self.chosen} (ms a token{at} at {ms}; {self.looks} look(s))"


class Threads:
    """The thread counts of one llama.cpp context, chosen by measurement. set(n_threads,
    n_threads_batch) applies a pair (llama_set_n_threads); batch: a fixed count for
    batches (-tb given), else measured too."""

    def __init__(self, counts: Sequence[int], set_counts: Callable[[int, int], None],
                 batch: int | None = None):
        top = max(counts)
        self.single = _Class(tuple(counts), top)
        self.batch = _Class(tuple(counts), top) if batch is None else None
        self._fixed_batch = batch
        self._set = set_counts
        self._applied: tuple[int, int] | None = None
        self.single.look("first look")
        if self.batch is not None:
            self.batch.look("first look")

    def _kind(self, n_tokens: int) -> _Class | None:
        return self.single if n_tokens == 1 else self.batch if n_tokens <= BATCH else None

    def before(self, n_tokens: int) -> None:
        """Ahead of a decode of n_tokens: the counts it runs with."""
        b = self.batch
        pair = (self.single.current, self._fixed_batch if b is None else
                b.current if n_tokens <= BATCH else b.chosen)
        if pair != self._applied:
            self._set(*pair)
            self._applied = pair

    def after(self, n_tokens: int, seconds: float) -> None:
        kind = self._kind(n_tokens)
        if kind is not None and n_tokens > 0:
            kind.timed(n_tokens, seconds / n_tokens)

    def describe(self) -> str:
        """What it chose and why, for the statistics."""
        batch = self.batch.describe() if self.batch is not None else \
            f"{self._fixed_batch} (-tb)"
        return f"auto: {self.single.describe()} for single tokens, {batch} for batches"
