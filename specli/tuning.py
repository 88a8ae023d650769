"""Measuring a draft on this machine: the estimators of the cost model (cost.py) and the probe
behind `check-pair --probe`.

Returns rows and figures; prints nothing. A draft of k tokens yields E(k) = 1 + S(1) + ... +
S(k) tokens per step, where S(j) is the measured share of steps whose first j draft tokens were
all accepted, and costs k draft decodes plus one target batch of k + 1 tokens; the speedup over
the target alone is E(k) / cost(k) times the target's time per token.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from specli.config import SamplingParams, SpecRequest
from specli.cost import CostModel, expected_tokens  # noqa: F401 - the model, re-exported
from specli.errors import UsageError
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
# a measurement judges itself: the target alone's speed varying more than this between its
# runs, or a measured speedup this far from the cost model's prediction, means the machine
# was busy (or the measurement too short) and the figures are not to be trusted
BUSY_SPREAD = 1.5
DISAGREE = 2.0


def _spread(values: Sequence[float]) -> float:
    """max / min of positive figures (1.0 for fewer than two)."""
    v = [x for x in values if x > 0]
    return max(v) / min(v) if len(v) > 1 else 1.0


def judge(baseline_tps: Sequence[float], measured: float | None = None,
          predicted: float | None = None) -> str | None:
    """Why a measurement is unreliable, or None: the target alone's runs varied (a busy
    machine), or the measured speedup and the cost model's prediction disagree by more than
    DISAGREE times."""
    spread = _spread(baseline_tps)
    if spread > BUSY_SPREAD:
        return f"the machine was busy (the target alone varied {spread:.1f}x between runs)"
    if measured and predicted and max(measured, predicted) / min(measured, predicted) \
            > DISAGREE:
        return (f"measured {measured:.2f}x but the cost model predicts {predicted:.2f}x (a "
                "busy machine?)")
    return None


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
class ProbeResult:
    n_draft: int
    rows: tuple[ProbeRow, ...]
    accept_rate: float
    accept_rate_per_pos: tuple[float, ...]  # S(j): share of steps with the first j accepted
    speedup: float  # measured at n_draft, all prompts together
    suggested_draft: int
    estimated_speedup: float  # at suggested_draft, from the cost model
    worth_it: bool
    costs: CostModel | None = field(default=None, repr=False)
    unreliable: str | None = None  # why the figures are not to be trusted (judge)

    @property
    def recommendation(self) -> str:
        measured = f"measured {self.speedup:.2f}x at --draft {self.n_draft}"
        if self.unreliable:
            return (f"unreliable: {self.unreliable}; rerun on an idle machine ({measured}, "
                    f"estimated {self.estimated_speedup:.2f}x at --draft "
                    f"{self.suggested_draft})")
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


def best_draft(s: Sequence[float], c: CostModel, k_max: int) -> tuple[int, float]:
    """The k in 1..k_max with the highest predicted speedup, and that speedup."""
    return max(((k, c.speedup(s, k)) for k in range(1, k_max + 1)), key=lambda kv: kv[1])


def costs(spec: Sequence[Stats], base: Sequence[Stats], k_max: int) -> CostModel:
    """The cost model from speculative and target-alone runs of the same prompts: the
    verification cost v(n) as a line through the target-alone token cost and the mean
    verification batch actually run."""
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
    slope = max(0.0, (t_verify - t1) / (batch - 1)) if batch > 1 and t1 > 0 else 0.0
    steps = sum(s.n_steps for s in spec)
    o_step = sum(s.overhead_s for s in spec) / max(steps, 1)
    return CostModel(t_draft, tuple(t1 + slope * n for n in range(k_max + 1)), o_step, o_token)


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
    n_draft = engine.draft_params.n_max
    c = costs(spec, base, n_draft)
    k, est = best_draft(s_j, c, min(n_draft, len(s_j)) or 1)
    n_spec = sum(s.n_predict for s in spec)
    spec_tps = n_spec / max(sum(s.t_decode_s for s in spec), 1e-9)
    base_tps = sum(b.n_predict for b in base) / max(sum(b.t_decode_s for b in base), 1e-9)
    drafted, accepted = sum(s.n_drafted for s in spec), sum(s.n_accept for s in spec)
    speedup = spec_tps / base_tps if base_tps > 0 else 0.0
    at_n = c.speedup(s_j, min(n_draft, len(s_j))) if s_j else None  # predicted where measured
    return ProbeResult(
        n_draft=n_draft, rows=tuple(rows),
        accept_rate=accepted / drafted if drafted else 0.0, accept_rate_per_pos=s_j,
        speedup=speedup, suggested_draft=k, estimated_speedup=est,
        worth_it=max(est, speedup) >= WORTH_IT, costs=c,
        # the target alone runs once per prompt (prompts differ: no spread to judge), so
        # only the measured speedup against the prediction tells a busy machine
        unreliable=judge([], speedup, at_n))


# -- tune-draft: a sweep over draft settings, against a baseline measured in the same run ----

# a few prompts per kind of text, after the seeds' acceptance table (seed 000)
PROMPT_SETS: dict[str, tuple[str, ...]] = {
    "code-completion": (
        "Complete this Python function:\n\ndef merge_sorted(a: list[int], b: list[int]) -> "
        "list[int]:\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
        "Complete this JavaScript:\n\nfunction debounce(fn, ms) {\n  let timer;\n",
    ),
    "code-generation": (
        "Write a Python function that checks whether a string is a palindrome.",
        "Write a Rust function that parses an IPv4 address from a string.",
    ),
    "structured": (
        'Return a JSON object describing three books, with the keys "title", "author" and '
        '"year".',
        "Write a SQL query that finds the top 3 customers by total order value.",
    ),
    "summarisation": (
        "Summarize in three sentences: The printing press, invented by Johannes Gutenberg "
        "around 1440, made books cheaper and faster to produce. Literacy spread, ideas "
        "travelled further, and the Reformation and the Scientific Revolution followed.",
    ),
    "chat": (
        "What should I pack for a weekend hiking trip?",
        "How do I make my morning routine more productive?",
    ),
    "creative": (
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Write a poem about the first snow of winter.",
    ),
}
MAX_POINTS = 64  # the grid's guard: a sweep longer than this is a mistake, not a plan


@dataclass(frozen=True)
class Setting:
    """One point of the grid: the draft length, the draft's probability floor, the sources,
    and for a draft tree its sequences and split probability."""

    k: int
    p_min: float
    types: tuple[str, ...]
    n_seq: int = 1
    p_split: float = 0.1

    @property
    def label(self) -> str:
        p = f" p-min {self.p_min:g}" if self.p_min else ""
        tree = f" n-seq {self.n_seq} p-split {self.p_split:g}" if self.n_seq > 1 else ""
        return f"{'+'.join(self.types)} k={self.k}{p}{tree}"


@dataclass
class Point:
    setting: Setting | None  # None: the baseline (target alone)
    tps: list[float] = field(default_factory=list)  # one figure per repeat, all prompts
    n_drafted: int = 0
    n_accept: int = 0
    n_steps: int = 0
    n_branches: int = 0  # draft-tree leaves over all steps (n_steps for single sequences)
    accepted_per_pos: list[int] = field(default_factory=list)
    speedup: float = 0.0
    predicted: float | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.tps) if self.tps else 0.0

    @property
    def accept_rate(self) -> float:
        return self.n_accept / self.n_drafted if self.n_drafted else 0.0

    @property
    def mean_accept_len(self) -> float:
        return 1 + self.n_accept / self.n_steps if self.n_steps else 1.0

    def add(self, s: Stats) -> None:
        self.n_drafted += s.n_drafted
        self.n_accept += s.n_accept
        self.n_steps += s.n_steps
        self.n_branches += s.n_branches
        for j, a in enumerate(s.accepted_per_pos):
            if j >= len(self.accepted_per_pos):
                self.accepted_per_pos.append(0)
            self.accepted_per_pos[j] += a

    def to_dict(self) -> dict:
        st = self.setting
        return {"baseline": st is None, "label": st.label if st else "target alone",
                "draft": st.k if st else None, "draft_p_min": st.p_min if st else None,
                "draft_n_seq": st.n_seq if st else None,
                "draft_p_split": st.p_split if st and st.n_seq > 1 else None,
                "spec_types": list(st.types) if st else [],
                "tps_median": self.median, "tps_min": min(self.tps, default=0.0),
                "tps_max": max(self.tps, default=0.0), "tps_runs": self.tps,
                "accept_rate": self.accept_rate, "mean_accept_len": self.mean_accept_len,
                "branches_per_step": self.n_branches / self.n_steps if self.n_steps else 0.0,
                "speedup": self.speedup, "predicted_speedup": self.predicted}


def grid(drafts: Sequence[int], p_mins: Sequence[float], types: Sequence[tuple[str, ...]],
         n_seqs: Sequence[int] = (1,), p_splits: Sequence[float] = (0.1,)) -> list[Setting]:
    """Every combination; a single sequence once, whatever the split probabilities."""
    trees = [(n, s) for n in n_seqs for s in (p_splits if n > 1 else p_splits[:1])]
    points = [Setting(k, p, t, n, sp) for t in types for n, sp in trees for p in p_mins
              for k in drafts]
    if len(points) > MAX_POINTS:
        raise UsageError(f"the sweep has {len(points)} settings (at most {MAX_POINTS})",
                         hint="fewer --draft, --draft-p-min, --draft-n-seq, --draft-p-split "
                         "or --spec-type values")
    return points


def measure_costs(engine, prompt: Sequence[int], k_max: int, repeat: int = 3) -> CostModel:
    """Time target decodes of 1..k_max+1 tokens and single draft decodes after `prompt`,
    rewinding after each: the inputs of the cost model."""
    tgt = engine.target
    dm = engine.draft_model
    tgt.sync(prompt)
    base = len(tgt.tokens)
    filler = list(prompt[-1:]) * (k_max + 1)
    v = []
    for n in range(1, k_max + 2):
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            tgt.decode(filler[:n], logits="all")
            times.append(time.perf_counter() - t0)
            tgt.rewind(base)
        v.append(statistics.median(times))
    c = 0.0
    if dm is not None:
        dm.sync(prompt)
        times = []
        for _ in range(repeat * 2):
            t0 = time.perf_counter()
            dm.decode(filler[:1], logits="last")
            times.append(time.perf_counter() - t0)
            dm.rewind(len(prompt))
        c = statistics.median(times)
    return CostModel(c, tuple(v))


@dataclass
class Sweep:
    baseline: Point
    points: list[Point]
    costs: CostModel | None = None

    @property
    def best(self) -> Point:
        return max(self.points, key=lambda p: p.median)

    @property
    def predicted_best(self) -> int | None:
        pts = [p for p in self.points if p.predicted is not None]
        return max(pts, key=lambda p: p.predicted).setting.k if pts else None

    @property
    def unreliable(self) -> str | None:
        """Why the sweep is not to be trusted (judge: the baseline's runs, and the best
        setting measured against its prediction), or None."""
        b = self.best
        return judge(self.baseline.tps, b.speedup, b.predicted)

    def to_dict(self) -> dict:
        b = self.best
        return {"baseline": self.baseline.to_dict(), "points": [p.to_dict() for p in self.points],
                "best": b.to_dict(), "beats_baseline": b.speedup > 1.0,
                "repeat": len(self.baseline.tps), "unreliable": self.unreliable,
                "predicted_best_draft": self.predicted_best,
                "costs": {"draft_s_per_token": self.costs.c,
                          "verify_s_by_batch": list(self.costs.v)} if self.costs else None}


def sweep(engine, prompts: Sequence[list[int]], settings: Sequence[Setting], n_predict: int,
          repeat: int, progress: Callable[[str, str, int, int], None] | None = None) -> Sweep:
    """Greedy generation on every prompt for every setting and for the target alone, `repeat`
    times. Each repeat runs the baseline and the settings in a rotated order, so that a drift
    in the machine's speed hits them all alike. progress(label, figures, done, total) after
    each finished run of a setting (figures: its tokens/s and acceptance, as text)."""
    greedy = SamplingParams(temp=0.0, seed=0)
    engine.complete(prompts[0], 4, greedy, speculative=False)  # page the weights in
    base = Point(None)
    points = [Point(s) for s in settings]
    runs: list[Point] = [base, *points]
    total, done = repeat * len(runs), 0
    for r in range(repeat):
        shift = r % len(runs)
        for point in runs[shift:] + runs[:shift]:
            tokens, seconds, drafted, accepted = 0, 0.0, 0, 0
            for ids in prompts:
                s = point.setting
                spec = SpecRequest(types=s.types, n_max=s.k, p_min=s.p_min, n_seq=s.n_seq,
                                   p_split=s.p_split) if s else None
                stats = engine.complete(ids, n_predict, greedy, speculative=s is not None,
                                        spec=spec).stats
                tokens += stats.n_predict
                seconds += stats.t_decode_s
                drafted, accepted = drafted + stats.n_drafted, accepted + stats.n_accept
                point.add(stats)
            point.tps.append(tokens / seconds if seconds else 0.0)
            done += 1
            if progress:
                figures = f"{point.tps[-1]:.1f} t/s" + (
                    f", accept {accepted / drafted:.1%}" if drafted else "")
                progress(point.setting.label if point.setting else "target alone", figures,
                         done, total)
    for p in points:
        p.speedup = p.median / base.median if base.median else 0.0
    return Sweep(base, points)


def predict(sw: Sweep, model: CostModel) -> None:
    """Fill each point's predicted speedup from its own measured S(j) and the cost model."""
    sw.costs = model
    for p in sw.points:
        if p.n_steps and p.setting.n_seq == 1:  # the model prices one draft sequence
            s = [a / p.n_steps for a in p.accepted_per_pos]
            # an n-gram lookup costs next to nothing: only a draft model pays c per token
            m = model if "draft-simple" in p.setting.types else replace(model, c=0.0)
            p.predicted = m.speedup(s, p.setting.k)
