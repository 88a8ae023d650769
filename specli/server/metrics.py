"""Prometheus metrics: counters in base units (tokens, seconds, requests), from each request's
Stats, plus gauges of the slots, under specli_* names; and the same figures under llama-server's
llamacpp:* names, so that dashboards made for llama-server work unchanged. One registry per
app, so several apps (tests) never mix."""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from specli.stats import Stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"specli_{name}", doc, labels, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.prompt_seconds = counter("prompt_seconds", "Time spent on prompts.")
        self.tokens_predicted = counter("tokens_predicted", "Tokens generated.")
        self.predicted_seconds = counter("tokens_predicted_seconds",
                                         "Time spent generating tokens.")
        self.drafts = counter("drafts", "Drafts verified by the target (speculative steps).")
        self.plain_steps = counter("plain_steps", "Steps that decoded the target alone (no "
                                   "draft, or --draft auto chose none).")
        self.draft_tokens = counter("draft_tokens", "Draft tokens sent to the target.")
        self.draft_accepted = counter("draft_tokens_accepted",
                                      "Draft tokens the target accepted.")
        self.accepted_per_pos = counter(
            "draft_tokens_accepted_per_position",
            "Draft tokens accepted at each draft position (1 = the first drafted token).",
            ("position",))
        self.drafted_per_pos = counter(
            "draft_tokens_per_position", "Draft tokens proposed at each draft position.",
            ("position",))
        self.requests = counter("requests", "Requests answered, by route and status code.",
                                ("route", "code"))
        self.slots_busy = Gauge("specli_slots_busy", "Slots generating now.", registry=r)
        self.slots_total = Gauge("specli_slots", "Slots (--parallel).", registry=r)
        self.queue = Gauge("specli_requests_waiting", "Requests waiting for a slot.",
                           registry=r)

        self.llama = LlamaMetrics()  # written by hand after the registry's (its text())

    def observe(self, s: Stats) -> None:
        """Count one finished (or abandoned) generation."""
        self.llama.observe(s)
        self.prompt_tokens.inc(s.n_prompt)
        self.prompt_seconds.inc(s.t_encode_s)
        self.tokens_predicted.inc(s.n_predict)
        self.predicted_seconds.inc(s.t_decode_s)
        self.drafts.inc(s.n_steps)
        self.plain_steps.inc(s.n_plain)
        self.draft_tokens.inc(s.n_drafted)
        self.draft_accepted.inc(s.n_accept)
        for i, (d, a) in enumerate(zip(s.drafted_per_pos, s.accepted_per_pos, strict=True)):
            self.drafted_per_pos.labels(position=str(i + 1)).inc(d)
            self.accepted_per_pos.labels(position=str(i + 1)).inc(a)

    def render(self, busy: int, total: int, waiting: int,
               kv: Callable[[], tuple[int, int]] = lambda: (0, 0),
               decodes: tuple[int, int] = (0, 0)) -> bytes:
        """The exposition; kv() gives the tokens cached in all slots and the slots' room;
        decodes: the target's llama_decode calls and the slots they held, in all."""
        self.slots_busy.set(busy)
        self.slots_total.set(total)
        self.queue.set(waiting)
        self.llama.now = (busy, waiting, *kv())
        self.llama.decodes = decodes
        return generate_latest(self.registry) + self.llama.text().encode()


class LlamaMetrics:
    """llama-server's llamacpp:* series (its server-task.cpp to_metrics), from the same Stats:
    totals as counters; throughput gauges averaged over the window since the previous
    scrape, as llama-server does; the slots and the KV cache as they are now; the target's
    decodes as the slots' loop counts them (batching.SharedContext)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # observe runs on the slots' threads, collect on the loop
        self.prompt_tokens = self.prompt_cached = self.predicted = self.drafted = 0
        self.accepted = self.drafts = self.n_tokens_max = 0
        self.prompt_s = self.predicted_s = 0.0
        self.accepted_per_pos: list[int] = []
        self.now = (0, 0, 0, 0)  # busy slots, waiting requests, KV tokens, KV room
        self.decodes = (0, 0)  # the target's llama_decode calls, and the slots in them
        # throughput since the last scrape: (tokens, seconds) for prompts and generation
        self._window = [0, 0.0, 0, 0.0]

    def observe(self, s: Stats) -> None:
        with self.lock:
            self._observe(s)

    def _observe(self, s: Stats) -> None:
        evaluated = s.target.prompt_n + 1 if s.n_prompt else 0
        self.prompt_tokens += evaluated
        self.prompt_cached += max(s.n_prompt - evaluated, 0)
        self.prompt_s += s.t_encode_s
        self.predicted += s.n_predict
        self.predicted_s += s.t_decode_s
        self.drafted += s.n_drafted
        self.accepted += s.n_accept
        self.drafts += s.n_steps
        self.n_tokens_max = max(self.n_tokens_max, s.n_prompt + s.n_predict)
        grow = len(s.accepted_per_pos) - len(self.accepted_per_pos)
        self.accepted_per_pos.extend([0] * max(grow, 0))
        for i, a in enumerate(s.accepted_per_pos):
            self.accepted_per_pos[i] += a
        w = self._window
        w[0] += evaluated
        w[1] += s.t_encode_s
        w[2] += s.n_predict
        w[3] += s.t_decode_s

    def text(self) -> str:
        """The llamacpp:* series in the exposition format, as llama-server writes them: by
        hand, since its names are not all Prometheus client names (n_tokens_max is a counter
        without _total). A snapshot: the scrape window is read and reset at once."""
        with self.lock:
            rows = self._rows()
        out = []
        for name, kind, doc, value in rows:
            if isinstance(value, list):  # a labelled family: (labels, value) pairs
                out += [f"# HELP llamacpp:{name} {doc}", f"# TYPE llamacpp:{name} {kind}"]
                out += [f"llamacpp:{name}{{{labels}}} {float(v)!r}" for labels, v in value]
            else:
                out += [f"# HELP llamacpp:{name} {doc}", f"# TYPE llamacpp:{name} {kind}",
                        f"llamacpp:{name} {float(value)!r}"]
        return "\n".join(out) + "\n"

    def _rows(self) -> list[tuple[str, str, str, float | list]]:
        n_p, s_p, n_g, s_g = self._window
        self._window = [0, 0.0, 0, 0.0]  # the gauges average over the window between scrapes
        n_dec, n_seqs = self.decodes
        busy, waiting, kv_tokens, kv_room = self.now
        rows = [
            ("prompt_tokens_total", "counter", "Number of prompt tokens processed, excluding "
             "cached tokens", self.prompt_tokens),
            ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the "
             "cache", self.prompt_cached),
            ("prompt_seconds_total", "counter", "Total time spent processing prompts",
             self.prompt_s),
            ("tokens_predicted_total", "counter", "Number of generation tokens processed",
             self.predicted),
            ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens",
             self.predicted_s),
            ("n_decode_total", "counter", "Total number of llama_decode() calls", n_dec),
            ("n_tokens_max", "counter", "Largest observed n_tokens", self.n_tokens_max),
            ("spec_decode_num_draft_tokens_total", "counter", "Speculative: Total draft "
             "tokens generated", self.drafted),
            ("spec_decode_num_accepted_tokens_total", "counter", "Speculative: Total draft "
             "tokens accepted by the target model", self.accepted),
            ("spec_decode_num_drafts_total", "counter", "Speculative: Total speculative "
             "decoding verification steps", self.drafts),
            ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s",
             n_p / s_p if s_p else 0.0),
            ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s",
             n_g / s_g if s_g else 0.0),
            ("requests_processing", "gauge", "Number of requests processing", busy),
            ("requests_deferred", "gauge", "Number of requests deferred", waiting),
            ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per "
             "llama_decode() call", n_seqs / n_dec if n_dec else 0.0),
            ("kv_cache_tokens", "gauge", "KV-cache tokens (the target's, all slots)",
             kv_tokens),
            ("kv_cache_usage_ratio", "gauge", "KV-cache usage: 1 means 100 percent usage",
             kv_tokens / kv_room if kv_room else 0.0),
        ]
        if self.accepted_per_pos:
            rows.append(("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                         "Accepted tokens per draft position",
                         [(f'position="{i}"', a) for i, a in enumerate(self.accepted_per_pos)]))
        return rows
