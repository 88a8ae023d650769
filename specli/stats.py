"""Run statistics as data; `format_llama` prints them the way llama.cpp does, `to_dict` for JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class ModelPerf:
    """Wall-clock buckets for one model.

    llama_perf_context would bill one context's time to another when two are interleaved."""

    load_ms: float = 0.0
    prompt_ms: float = 0.0  # prefill decodes
    prompt_n: int = 0  # tokens prefilled
    eval_ms: float = 0.0  # decodes during generation
    eval_runs: int = 0  # llama_decode calls during generation
    eval_n: int = 0  # tokens in those calls
    threads: str = ""  # its thread counts: as given (-t N), or -t auto's choice and why

    def perf_lines(self) -> list[str]:
        name = "llama_perf_context_print"
        return [
            f"{name}:        load time = {self.load_ms:10.2f} ms",
            f"{name}: prompt eval time = {self.prompt_ms:10.2f} ms / {self.prompt_n:5d} tokens "
            f"({_div(self.prompt_ms, self.prompt_n):8.2f} ms per token, "
            f"{_div(1e3 * self.prompt_n, self.prompt_ms):8.2f} tokens per second)",
            f"{name}:        eval time = {self.eval_ms:10.2f} ms / {self.eval_runs:5d} runs   "
            f"({_div(self.eval_ms, self.eval_runs):8.2f} ms per token, "
            f"{_div(1e3 * self.eval_runs, self.eval_ms):8.2f} tokens per second)",
            f"{name}:       total time = {self.prompt_ms + self.eval_ms:10.2f} ms / "
            f"{self.prompt_n + self.eval_n:5d} tokens",
        ]


def _div(a: float, b: float) -> float:
    return a / b if b else 0.0


@dataclass
class Stats:
    """Everything one generation measured. Field names are the stable JSON keys (docs/stats.md)."""

    n_draft: int = 0  # configured maximum draft length (k)
    n_prompt: int = 0
    t_encode_s: float = 0.0
    n_predict: int = 0
    t_decode_s: float = 0.0
    n_steps: int = 0  # verification steps that checked a draft
    n_plain: int = 0  # steps that decoded the target alone (no draft; or --draft auto chose 0)
    n_drafted: int = 0
    n_accept: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    t_first_s: float = 0.0  # generation time until the first step's tokens were emitted
    n_first: int = 0  # tokens the first step emitted (1, plus any accepted draft)
    t_draft_decode_s: float = 0.0  # inside the draft's llama_decode during generation
    t_target_decode_s: float = 0.0  # inside the target's llama_decode during generation
    draft: ModelPerf | None = None
    target: ModelPerf = field(default_factory=ModelPerf)
    seed: int | None = None
    # how drafts were verified: greedy, exact (the target's own seeded samples, matched) or
    # rejection (Leviathan/Chen); "" without a draft
    spec_sampling: str = ""
    finish_reason: str = ""
    # the context filled: shifted (--context-shift, n_shifts times) or the generation ended
    truncated: bool = False
    n_shifts: int = 0
    baseline_decode_tps: float | None = None
    # per draft source (llama.cpp's "statistics <type>:" lines): gen_drafts, acc_drafts,
    # gen_tokens, acc_tokens
    per_source: dict[str, dict[str, int]] = field(default_factory=dict)
    # draft trees (-np/--draft-n-seq > 1): the sequences allowed, the branches drafted over
    # all steps, the draft depths (llama-speculative's n_drafted: a draft decode per depth),
    # the longest accepted path; for a single sequence n_depths == n_drafted
    n_seq_dft: int = 1
    n_branches: int = 0
    n_depths: int = 0
    max_path: int = 0

    # -- derived figures -------------------------------------------------------------------
    @property
    def encode_tps(self) -> float:
        return _div(self.n_prompt, self.t_encode_s)

    @property
    def decode_tps(self) -> float:
        return _div(self.n_predict, self.t_decode_s)

    @property
    def accept_rate(self) -> float:
        return _div(self.n_accept, self.n_drafted)

    @property
    def mean_accept_len(self) -> float:
        """vLLM's mean acceptance length: tokens emitted per verified draft."""
        return 1.0 + _div(self.n_accept, self.n_steps)

    @property
    def accept_rate_per_pos(self) -> list[float]:
        pairs = zip(self.accepted_per_pos, self.drafted_per_pos, strict=True)
        return [_div(a, d) for a, d in pairs]

    @property
    def max_drafted(self) -> int:
        """The longest draft verified in this run (n_draft is the cap it was allowed)."""
        return len(self.drafted_per_pos)

    @property
    def overhead_s(self) -> float:
        """Decode wall time spent outside llama_decode (sampling, bookkeeping, Python)."""
        return max(0.0, self.t_decode_s - self.t_draft_decode_s - self.t_target_decode_s)

    @property
    def speedup(self) -> float | None:
        if not self.baseline_decode_tps:
            return None
        return self.decode_tps / self.baseline_decode_tps

    def drafting_with(self, names: Sequence[str]) -> None:
        """The sources a generation drafts with: each gets its statistics line, zeros
        included (a source that never drafted is shown, as llama.cpp shows it)."""
        for name in names:
            self._source(name)

    def _source(self, name: str) -> dict[str, int]:
        return self.per_source.setdefault(name, {
            "gen_drafts": 0, "acc_drafts": 0, "gen_tokens": 0, "acc_tokens": 0,
            "max_tokens": 0})

    def record_step(self, n_drafted: int, n_accepted: int, source: str = "",
                    depth: int | None = None, branches: int = 1) -> None:
        """Count one verification step that checked n_drafted tokens and accepted n_accepted.
        A draft tree: n_drafted counts its nodes, depth its deepest, branches its leaves."""
        if source:
            s = self._source(source)
            s["max_tokens"] = max(s["max_tokens"], n_drafted)
            s["gen_drafts"] += 1
            s["acc_drafts"] += n_accepted > 0
            s["gen_tokens"] += n_drafted
            s["acc_tokens"] += n_accepted
        self.n_steps += 1
        self.n_drafted += n_drafted
        self.n_accept += n_accepted
        depth = n_drafted if depth is None else depth
        self.n_branches += branches
        self.n_depths += depth
        self.max_path = max(self.max_path, n_accepted)
        if depth > len(self.drafted_per_pos):
            grow = depth - len(self.drafted_per_pos)
            self.drafted_per_pos.extend([0] * grow)
            self.accepted_per_pos.extend([0] * grow)
        for i in range(depth):
            self.drafted_per_pos[i] += 1
        for i in range(n_accepted):
            self.accepted_per_pos[i] += 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            encode_tps=self.encode_tps,
            decode_tps=self.decode_tps,
            accept_rate=self.accept_rate,
            mean_accept_len=self.mean_accept_len,
            accept_rate_per_pos=self.accept_rate_per_pos,
            max_drafted=self.max_drafted,
            overhead_s=self.overhead_s,
            speedup=self.speedup,
        )
        return d


MEASURABLE_S = 1e-3  # a rate over less time than this says more about the clock than the work


def _speed(tps: float, seconds: float) -> str:
    """A rate as llama.cpp prints it, or "-" when the time is too short to measure (a
    one-token prompt is one decode of no measurable length)."""
    return f"{tps:8.3f}" if seconds >= MEASURABLE_S else f"{'-':>8}"


def format_llama(s: Stats) -> str:
    """The statistics block of llama-speculative-simple, then what llama.cpp does not print."""
    lines = [
        f"encoded {s.n_prompt:4d} tokens in {s.t_encode_s:8.3f} seconds, "
        f"speed: {_speed(s.encode_tps, s.t_encode_s)} t/s",
        f"decoded {s.n_predict:4d} tokens in {s.t_decode_s:8.3f} seconds, "
        f"speed: {_speed(s.decode_tps, s.t_decode_s)} t/s",
        "",
        f"n_draft   = {s.n_draft}",  # the configured maximum, as llama-speculative-simple
        f"n_predict = {s.n_predict}",
        f"n_drafted = {s.n_drafted}",
        f"n_accept  = {s.n_accept}",
        f"accept    = {100.0 * s.accept_rate:.3f}%",
        "",
    ]
    if s.draft is not None:
        lines += ["draft:", "", *s.draft.perf_lines(), ""]
    lines += ["target:", "", *s.target.perf_lines(), ""]
    rates = s.accept_rate_per_pos
    last = max((i for i, a in enumerate(s.accepted_per_pos) if a), default=-1) + 1
    per_pos = ", ".join(f"{r:.3f}" for r in rates[:max(last, 1)]) or "-"
    if len(rates) > max(last, 1):  # drafted that deep, never accepted there
        per_pos += f" (positions {max(last, 1) + 1}-{len(rates)}: never accepted)"
    lines += [
        f"seed      = {s.seed if s.seed is not None else '-'}"
        + (f" (verified: {s.spec_sampling})" if s.spec_sampling else ""),
        f"finish    = {s.finish_reason or '-'}",
        f"max draft = {s.max_drafted} (the longest draft verified)",
        f"mean acceptance length = {s.mean_accept_len:.3f} (1 + accepted/steps, {s.n_steps} steps)",
        f"steps     = {s.n_steps} drafted, {s.n_plain} plain"
        + (f" (mean k {_div(s.n_drafted, s.n_steps):.2f})" if s.n_steps else ""),
        f"acceptance per position = {per_pos}",
        f"overhead  = {1e3 * _div(s.overhead_s, s.target.eval_runs):.3f} ms/step "
        f"({100.0 * _div(s.overhead_s, s.t_decode_s):.1f}% of decode time outside llama_decode)",
    ]
    if s.target.threads:
        lines.append(f"threads   = target {s.target.threads}" + (
            f"; draft {s.draft.threads}" if s.draft is not None and s.draft.threads else ""))
    lines += [f"statistics {name}: #gen drafts = {v['gen_drafts']}, #acc drafts = "
              f"{v['acc_drafts']}, #gen tokens = {v['gen_tokens']}, #acc tokens = "
              f"{v['acc_tokens']}, #max draft = {v.get('max_tokens', 0)}"
              for name, v in s.per_source.items()]
    if s.n_seq_dft > 1:
        lines += [
            f"draft tree = {s.n_seq_dft} sequences, {_div(s.n_branches, s.n_steps):.2f} "
            f"branches a step, {s.n_drafted} nodes over {s.n_depths} depths "
            f"(llama-speculative's n_drafted = {s.n_depths})",
            f"accepted path = {_div(s.n_accept, s.n_steps):.3f} mean, {s.max_path} longest",
        ]
    if s.speedup is not None:
        lines += [
            f"baseline  = {s.baseline_decode_tps:8.3f} t/s (target alone)",
            f"speedup   = {s.speedup:.3f}x",
        ]
    return "\n".join(lines) + "\n"
