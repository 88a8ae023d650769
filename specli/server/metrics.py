"""Prometheus metrics: counters in base units (tokens, seconds, requests), from each request's
Stats, plus gauges of the slots, under specli_* names; and the same figures under llama-server's
llamacpp:* names, so that dashboards made for llama-server work unchanged. One registry per
app, so several apps (tests) never mix."""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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

        self.llama = LlamaMetrics()
        r.register(self.llama)

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
               kv: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> bytes:
        """The exposition; kv() gives the tokens cached in all slots and the slots' room."""
        self.slots_busy.set(busy)
        self.slots_total.set(total)
        self.queue.set(waiting)
        self.llama.now = (busy, waiting, *kv())
        return generate_latest(self.registry)


class LlamaMetrics:
    """llama-server's llamacpp:* series (its server-task.cpp to_metrics), from the same Stats:
    totals as counters; throughput gauges averaged over the window since the previous
    scrape, as llama-server does; the slots and the KV cache as they are now. llama-server's
    n_decode_total and n_busy_slots_per_decode are not kept (specli does not count decode
    calls across slots)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # observe runs on the slots' threads, collect on the loop
        self.prompt_tokens = self.prompt_cached = self.predicted = self.drafted = 0
        self.accepted = self.drafts = self.n_tokens_max = 0
        self.prompt_s = self.predicted_s = 0.0
        self.accepted_per_pos: list[int] = []
        self.now = (0, 0, 0, 0)  # busy slots, waiting requests, KV tokens, KV room
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

    def describe(self) -> list:
        return []  # registered without a first collect: the values change after

    def collect(self):
        with self.lock:  # a snapshot: the window is read and reset at once
            families = list(self._collect())
        yield from families

    def _collect(self):
        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"llamacpp:{name}", doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"llamacpp:{name}", doc, value=value)

        yield counter("prompt_tokens", "Number of prompt tokens processed, excluding cached "
                      "tokens", self.prompt_tokens)
        yield counter("prompt_tokens_cached", "Number of prompt tokens reused from the cache",
                      self.prompt_cached)
        yield counter("prompt_seconds", "Total time spent processing prompts", self.prompt_s)
        yield counter("tokens_predicted", "Number of generation tokens processed",
                      self.predicted)
        yield counter("tokens_predicted_seconds", "Total time spent generating tokens",
                      self.predicted_s)
        yield gauge("n_tokens_max", "Largest observed sequence length (prompt + generation)",
                    self.n_tokens_max)
        yield counter("spec_decode_num_draft_tokens", "Speculative: Total draft tokens "
                      "generated", self.drafted)
        yield counter("spec_decode_num_accepted_tokens", "Speculative: Total draft tokens "
                      "accepted by the target model", self.accepted)
        yield counter("spec_decode_num_drafts", "Speculative: Total speculative decoding "
                      "verification steps", self.drafts)
        n_p, s_p, n_g, s_g = self._window
        self._window = [0, 0.0, 0, 0.0]  # the gauges average over the window between scrapes
        yield gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s",
                    n_p / s_p if s_p else 0.0)
        yield gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s",
                    n_g / s_g if s_g else 0.0)
        busy, waiting, kv_tokens, kv_room = self.now
        yield gauge("requests_processing", "Number of requests processing", busy)
        yield gauge("requests_deferred", "Number of requests deferred", waiting)
        yield gauge("kv_cache_tokens", "KV-cache tokens (the target's, all slots)", kv_tokens)
        yield gauge("kv_cache_usage_ratio", "KV-cache usage: 1 means 100 percent usage",
                    kv_tokens / kv_room if kv_room else 0.0)
        if self.accepted_per_pos:
            per = CounterMetricFamily("llamacpp:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position", labels=["position"])
            for i, a in enumerate(self.accepted_per_pos):
                per.add_metric([str(i)], a)
            yield per
