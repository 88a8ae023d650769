"""`--draft auto`: choose the draft length k each step from measured acceptance and cost.

A draft of k tokens yields E(k) = 1 + S(1) + ... + S(k) tokens per step, where S(j) is the
chance that its first j tokens are all accepted, at the cost of drafting k tokens plus
verifying k + 1. Everything is measured online: S(j) per source as a product of per-position
acceptance rates (no independence assumed: an n-gram match tends to be right all the way or
wrong at once), drafting time per token per source, and the target's verification time as a
linear function of the batch size (shared by all sources). k is the argmax of E(k) / cost(k).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from specli.config import DRAFT_AUTO_MAX, DraftPolicy, SamplingParams
from specli.cost import CostModel
from specli.drafts.base import Decoded, DraftSource, Outcome, Proposal, Reads, rules_kw

if TYPE_CHECKING:
    from specli.rules import Rules

DECAY = 0.95  # weight of the past per observation: about the last 20 steps count
# the prior cost of each extra token in a verification batch, relative to a batch of one
# (about 0.1 for SmolLM2 F32 on 2 CPU cores, 0.2-0.4 for larger models); measured thereafter
PRIOR_SLOPE = 0.15
PRIOR_WEIGHT = 4.0
EXPLORE = 0.1  # share of steps that try k +- 1, so the cost of other lengths stays known
PRIOR_STEPS = 2.0  # the weight, in steps, of the acceptance assumed before any is measured


class VerifyCost:
    """t(n) = a * (1 + s * (n - 1)) seconds to verify a batch of n tokens, fitted online: the
    verification half of the CostModel (cost.py) that --draft auto decides with."""

    def __init__(self) -> None:
        self.a = 0.0  # the cost of a batch of one; 0 until measured
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def add(self, n: int, seconds: float) -> None:
        for name in ("_w", "_sx", "_sy", "_sxx", "_sxy"):
            setattr(self, name, getattr(self, name) * DECAY)
        x = n - 1
        self._w += 1
        self._sx += x
        self._sy += seconds
        self._sxx += x * x
        self._sxy += x * seconds

    def fit(self) -> tuple[float, float]:
        """(a, slope), the slope shrunk towards the prior when the batch sizes barely vary."""
        if self._w == 0:
            return 0.0, PRIOR_SLOPE
        mx, my = self._sx / self._w, self._sy / self._w
        var = self._sxx / self._w - mx * mx
        cov = self._sxy / self._w - mx * my
        # least squares for the slope b in y = a + b x, shrunk towards the prior's slope
        a_prior = my / (1 + PRIOR_SLOPE * mx)
        b = (cov * self._w + PRIOR_WEIGHT * PRIOR_SLOPE * a_prior) / (var * self._w + PRIOR_WEIGHT)
        a = max(my - b * mx, 1e-9)
        return a, max(b / a, 0.0)


class Adaptive:
    """Wraps one draft source; caps the k it is asked for at the current best length."""

    def __init__(self, source: DraftSource, cost: VerifyCost, seed: int = 0,
                 prior: float = 0.7, n_min: int = 1,
                 clock: Callable[[], float] = time.perf_counter):
        self.source = source
        self.n_min = n_min  # --draft-min: a shorter draft is discarded, and nothing is learnt
        self.prior = prior  # per-token acceptance assumed before any is measured
        self._clock = clock
        self.name, self.own_length = source.name, source.own_length
        self.model = source.model
        self.cost = cost
        # decayed counts per draft position j (index j): steps that drafted j with 1..j-1
        # accepted, and steps that also had j accepted
        self._tried = np.zeros(DRAFT_AUTO_MAX + 1)
        self._hit = np.zeros(DRAFT_AUTO_MAX + 1)
        self._t_token = 0.0  # decayed drafting seconds per drafted token
        self._pending: tuple[int, float] | None = None  # (drafted, when the proposal returned)
        self._rng = np.random.default_rng(seed)  # exploration only: never touches the output
        self.k = 0  # the last length chosen

    @property
    def acceptance(self) -> float:
        """The pooled per-token acceptance rate (with its prior)."""
        a = ((self._hit[1:].sum() + PRIOR_STEPS * self.prior)
             / (self._tried[1:].sum() + PRIOR_STEPS))
        return min(max(float(a), 0.01), 0.99)

    def survival(self, k_max: int) -> np.ndarray:
        """S(j) for j = 1..k_max, the chance that the first j drafted tokens are accepted.
        Each position's acceptance rate is shrunk towards the rate of the position before
        it, so a position never tried inherits the deepest measured one: a run of full
        acceptances makes longer drafts worth trying."""
        rates = np.empty(k_max)
        prior = self.acceptance
        for j in range(1, k_max + 1):
            prior = (self._hit[j] + PRIOR_STEPS * prior) / (self._tried[j] + PRIOR_STEPS)
            rates[j - 1] = prior
        return np.cumprod(rates)

    def best_k(self, k_max: int) -> int:
        k_max = min(k_max, DRAFT_AUTO_MAX)
        if k_max <= 1:
            return k_max
        t1, slope = self.cost.fit()
        model = CostModel.line(self._t_token, t1 or 1.0, slope, k_max)
        k = 1 + int(np.argmax(model.speedups(self.survival(k_max))))
        if self._rng.random() < EXPLORE:
            k += int(self._rng.choice((-1, 1)))
        return min(max(k, self.n_min, 1), k_max)

    def begin(self, prompt: Sequence[int]) -> Reads | None:
        self._pending = None
        return self.source.begin(prompt)

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator, policy: DraftPolicy | None = None,
                rules: Rules | None = None) -> Proposal:
        self.k = self.best_k(k)
        t0 = self._clock()
        p = self.source.propose(context, self.k, sp, rng, policy, **rules_kw(rules))
        t1 = self._clock()
        if p.tokens:
            self._t_token = DECAY * self._t_token + (1 - DECAY) * (t1 - t0) / len(p.tokens)
            self._pending = (len(p.tokens), t1)
        return p

    def process(self, batch: Decoded) -> None:
        self.source.process(batch)

    def accept(self, outcome: Outcome) -> None:
        """A verified proposal: its cost and how far it was accepted."""
        n_accepted = outcome.n_accepted
        if outcome.tree is not None and self._pending is not None:
            drafted, t1 = self._pending
            self._pending = None
            self.cost.add(drafted + 1, self._clock() - t1)
            self._tried *= DECAY
            self._hit *= DECAY
            reached = min(n_accepted + 1, drafted, DRAFT_AUTO_MAX)  # the first rejected too
            self._tried[1:reached + 1] += 1
            self._hit[1:min(n_accepted, DRAFT_AUTO_MAX) + 1] += 1
        self.source.accept(outcome)

    def end(self) -> None:
        self.source.end()
