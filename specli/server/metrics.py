"""Prometheus metrics: counters in base units (tokens, seconds, requests), from each request's
Stats, plus gauges of the slots. One registry per app, so several apps (tests) never mix."""

from __future__ import annotations

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

    def observe(self, s: Stats) -> None:
        """Count one finished (or abandoned) generation."""
        self.prompt_tokens.inc(s.n_prompt)
        self.prompt_seconds.inc(s.t_encode_s)
        self.tokens_predicted.inc(s.n_predict)
        self.predicted_seconds.inc(s.t_decode_s)
        self.drafts.inc(s.n_steps)
        self.draft_tokens.inc(s.n_drafted)
        self.draft_accepted.inc(s.n_accept)
        for i, (d, a) in enumerate(zip(s.drafted_per_pos, s.accepted_per_pos, strict=True)):
            self.drafted_per_pos.labels(position=str(i + 1)).inc(d)
            self.accepted_per_pos.labels(position=str(i + 1)).inc(a)

    def render(self, busy: int, total: int, waiting: int) -> bytes:
        self.slots_busy.set(busy)
        self.slots_total.set(total)
        self.queue.set(waiting)
        return generate_latest(self.registry)
