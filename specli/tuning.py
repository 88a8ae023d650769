"""Measuring a draft on this machine: the cost model and the probe behind `check-pair --probe`.

Returns rows and figures; prints nothing. A draft of k tokens yields E(k) = 1 + S(1) + ... +
S(k) tokens per step, where S(j) is the measured share of steps whose first j draft tokens were
all accepted, and costs k draft decodes plus one target batch of k + 1 tokens; the speedup over
the target alone is E(k) / cost(k) times the target's time per token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from specli.config import SamplingParams
from specli.stats import Stats

# a few prompts of the kinds the seeds' acceptance tables distinguish
PROBE_PROMPTS: tuple[tuple[str, str], ...] = (
    ("code", "Write a Python function that returns the n-th Fibonacci number, with a docstring "
             "and type hints."),
    ("structured", 'Return a JSON object describing three fruits, with the keys "name", '
                   '"color" and "calories".'),
    ("chat", "What should I pack for a weekend hiking trip?"),
)
WORTH_IT = 1.05  # a speedup below this is within the noise of a short probe


@dataclass(frozen=True)
class ProbeRow:
    kind: str
    n_predict: int
    n_drafted: int
    n_accept: int
    accept_rate: float
    speculative_tps: float
    baseline_tps: float
    speedup: float
    identical: bool  # greedy speculative output equals the target alone's


@dataclass(frozen=True)
class Costs:
    """Seconds per target token alone, per drafted token, and the extra cost of each token in a
    verification batch relative to a batch of one; Python's overhead per step and per token."""

    t_target: float
    t_draft: float
    slope: float
    overhead_step: float
    overhead_token: float


@dataclass(frozen=True)
class ProbeResult:
    n_draft: int
    rows: tuple[ProbeRow, ...]
    accept_rate: float
    accept_rate_per_pos: tuple[float, ...]  # S(j): share of steps with the first j accepted
    speedup: float  # measured at n_draft, all prompts together
    suggested_draft: int
    estimated_speedup: float  # at suggested_draft, from the cost model
    worth_it: bool
    costs: Costs | None = field(default=None, repr=False)

    @property
    def recommendation(self) -> str:
        measured = f"measured {self.speedup:.2f}x at --draft {self.n_draft}"
        if self.worth_it:
            return (f"worth it: use --draft {self.suggested_draft} ({measured}; estimated "
                    f"{self.estimated_speedup:.2f}x at --draft {self.suggested_draft})")
        return (f"not worth it on this machine ({measured}; at best an estimated "
                f"{self.estimated_speedup:.2f}x at --draft {self.suggested_draft}): use the "
                "target alone, an n-gram draft (--spec-type ngram-mod) for text that repeats "
                "its input, or a smaller draft")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["recommendation"] = self.recommendation
        return d


def expected_tokens(s: Sequence[float], k: int) -> float:
    """E(k) = 1 + S(1) + ... + S(k); positions never measured count as never accepted."""
    return 1.0 + sum(s[:k])


def estimated_speedup(s: Sequence[float], c: Costs, k: int) -> float:
    step = k * c.t_draft + c.t_target * (1 + c.slope * k) + c.overhead_step
    return expected_tokens(s, k) * (c.t_target + c.overhead_token) / step if step > 0 else 0.0


def best_draft(s: Sequence[float], c: Costs, k_max: int) -> tuple[int, float]:
    """The k in 1..k_max with the highest estimated speedup, and that speedup."""
    return max(((k, estimated_speedup(s, c, k)) for k in range(1, k_max + 1)),
               key=lambda kv: kv[1])


def costs(spec: Sequence[Stats], base: Sequence[Stats]) -> Costs:
    """The cost model's figures from speculative and target-alone runs of the same prompts."""
    runs = sum(b.target.eval_runs for b in base)
    t1 = sum(b.t_target_decode_s for b in base) / max(runs, 1)
    base_tokens = sum(b.n_predict for b in base)
    o_token = sum(b.overhead_s for b in base) / max(base_tokens, 1)
    drafted = sum(s.n_drafted for s in spec)
    t_draft = sum(s.t_draft_decode_s for s in spec) / max(drafted, 1)
    v_runs = sum(s.target.eval_runs for s in spec)
    v_tokens = sum(s.target.eval_n for s in spec)
    t_verify = sum(s.t_target_decode_s for s in spec) / max(v_runs, 1)
    batch = v_tokens / max(v_runs, 1)
    slope = max(0.0, (t_verify / t1 - 1) / (batch - 1)) if batch > 1 and t1 > 0 else 0.0
    steps = sum(s.n_steps for s in spec)
    o_step = sum(s.overhead_s for s in spec) / max(steps, 1)
    return Costs(t1, t_draft, slope, o_step, o_token)


def probe(engine, n_predict: int, prompts: Sequence[tuple[str, str]] = PROBE_PROMPTS,
          progress: Callable[[str], None] | None = None) -> ProbeResult:
    """Greedy generation on each prompt, speculative and with the target alone, on a loaded
    Engine with a draft; acceptance, measured speedup and the draft length the cost model
    suggests."""
    greedy = SamplingParams(temp=0.0, seed=0)
    warm = engine.tokenize(prompts[0][1], chat=True)
    engine.complete(warm, 4, greedy)  # page the weights in before anything is timed
    rows, spec, base = [], [], []
    for i, (kind, text) in enumerate(prompts):
        if progress:
            progress(f"probing {kind} prompt ({i + 1}/{len(prompts)})")
        ids = engine.tokenize(text, chat=True)
        s = engine.complete(ids, n_predict, greedy)
        b = engine.complete(ids, n_predict, greedy, speculative=False)
        spec.append(s.stats)
        base.append(b.stats)
        rows.append(ProbeRow(kind, s.stats.n_predict, s.stats.n_drafted, s.stats.n_accept,
                             s.stats.accept_rate, s.stats.decode_tps, b.stats.decode_tps,
                             s.stats.decode_tps / b.stats.decode_tps if b.stats.decode_tps
                             else 0.0, s.tokens == b.tokens))
    # S(j) over every step, not only those that drafted j tokens: a draft cut short (by
    # --draft-p-min or the token budget) counts as not reaching j
    depth = max((len(s.accepted_per_pos) for s in spec), default=0)
    steps = sum(s.n_steps for s in spec)
    s_j = tuple(sum(s.accepted_per_pos[j] for s in spec if j < len(s.accepted_per_pos))
                / steps for j in range(depth)) if steps else ()
    c = costs(spec, base)
    n_draft = engine.draft_params.n_max
    k, est = best_draft(s_j, c, min(n_draft, len(s_j)) or 1)
    n_spec = sum(s.n_predict for s in spec)
    spec_tps = n_spec / max(sum(s.t_decode_s for s in spec), 1e-9)
    base_tps = sum(b.n_predict for b in base) / max(sum(b.t_decode_s for b in base), 1e-9)
    drafted, accepted = sum(s.n_drafted for s in spec), sum(s.n_accept for s in spec)
    speedup = spec_tps / base_tps if base_tps > 0 else 0.0
    return ProbeResult(
        n_draft=n_draft, rows=tuple(rows),
        accept_rate=accepted / drafted if drafted else 0.0, accept_rate_per_pos=s_j,
        speedup=speedup, suggested_draft=k, estimated_speedup=est,
        worth_it=max(est, speedup) >= WORTH_IT, costs=c)
