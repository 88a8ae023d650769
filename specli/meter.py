"""Where a generation's time goes: wall-clock buckets per model, filled into Stats, and the
prompt's progress as llama-server reports it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from specli.stats import ModelPerf, Stats

if TYPE_CHECKING:
    from specli.backend import Decoder


class Meter:
    """Wall-clock buckets per model, for the prompt and for the generation: the seconds inside
    each model's decodes, its decode calls and tokens (llama_perf_context would bill one
    context's work to the other when two are interleaved)."""

    def __init__(self, stats: Stats, target: Decoder, draft: Decoder | None):
        stats.target = ModelPerf(load_ms=target.load_ms)
        stats.draft = ModelPerf(load_ms=draft.load_ms) if draft is not None else None
        self.stats = stats
        self.models = [(target, stats.target)] + ([(draft, stats.draft)] if draft else [])

    @contextmanager
    def prompt(self) -> Iterator[None]:
        t0, before = time.perf_counter(), [_usage(m) for m, _ in self.models]
        yield
        self.stats.t_encode_s = time.perf_counter() - t0
        for (m, perf), b in zip(self.models, before, strict=True):
            secs, _, perf.prompt_n = _since(m, b)
            perf.prompt_ms = 1e3 * secs

    @contextmanager
    def decode(self) -> Iterator[None]:
        t0, before = time.perf_counter(), [_usage(m) for m, _ in self.models]
        try:
            yield
        finally:
            s = self.stats
            s.t_decode_s = time.perf_counter() - t0
            for (m, perf), b in zip(self.models, before, strict=True):
                secs, perf.eval_runs, perf.eval_n = _since(m, b)
                perf.eval_ms = 1e3 * secs
                perf.threads = m.threads
            s.t_target_decode_s = s.target.eval_ms / 1e3
            s.t_draft_decode_s = s.draft.eval_ms / 1e3 if s.draft is not None else 0.0


def prompt_progress(report: Callable[[dict], None], total: int) -> Callable[[int, int], None]:
    """sync's progress as llama-server reports it, batches cut over the whole prompt: the
    last prompt token, decoded at once by the first verification, counts in the last."""
    t0 = time.perf_counter()

    def on_progress(cache: int, done: int) -> None:
        report({"total": total, "cache": cache, "processed": done,
                "time_ms": 1e3 * (time.perf_counter() - t0)})

    return on_progress


def _usage(m: Decoder | None) -> tuple[float, int, int]:
    """(seconds inside llama_decode, decode calls, tokens decoded) so far."""
    return (m.t_decode_s, m.n_decode_calls, m.n_decode_tokens) if m is not None else (0.0, 0, 0)


def _since(m: Decoder | None, before: tuple[float, int, int]) -> tuple[float, int, int]:
    now = _usage(m)
    return now[0] - before[0], now[1] - before[1], now[2] - before[2]
