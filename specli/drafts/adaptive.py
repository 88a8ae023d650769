"""`--draft auto`: choose the draft length k each step from measured acceptance and cost.

Under the usual model (each drafted token accepted with probability a, independently), a draft
of k tokens yields E(k) = (1 - a^(k+1)) / (1 - a) tokens per step at a cost of drafting k tokens
plus verifying k + 1. Both are measured online: `a` per source from accepted/rejected counts,
drafting time per token per source, and the target's verification time as a linear function of
the batch size (shared by all sources). k is the argmax of E(k) / cost(k).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from specli.config import SamplingParams
from specli.drafts.base import DraftSource, Proposal

DECAY = 0.95  # weight of the past per observation: about the last 20 steps count
# a verification batch of 8 costs 2.5-3.7x one token on a 2-core CPU: the prior per-token slope
PRIOR_SLOPE = 0.3
PRIOR_WEIGHT = 4.0
EXPLORE = 0.1  # share of steps that try k +- 1, so the cost of other lengths stays known


class VerifyCost:
    """t(n) = a * (1 + s * (n - 1)) seconds to verify a batch of n tokens, fitted online."""

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
                 clock: Callable[[], float] = time.perf_counter):
        self.source = source
        self._clock = clock
        self.name = source.name
        self.cost = cost
        self._acc = 4 * 0.6  # decayed accepted tokens, with a prior of a = 0.6
        self._trials = 4.0  # decayed accepted + rejected tokens
        self._t_token = 0.0  # decayed drafting seconds per drafted token
        self._pending: tuple[int, float] | None = None  # (drafted, when the proposal returned)
        self._rng = np.random.default_rng(seed)  # exploration only: never touches the output
        self.k = 0  # the last length chosen

    @property
    def acceptance(self) -> float:
        return min(max(self._acc / self._trials, 0.01), 0.99)

    def best_k(self, k_max: int) -> int:
        if k_max <= 1:
            return k_max
        a = self.acceptance
        t1, slope = self.cost.fit()
        t1 = t1 or 1.0
        ks = np.arange(1, k_max + 1)
        expected = (1 - a ** (ks + 1)) / (1 - a)
        seconds = self._t_token * ks + t1 * (1 + slope * ks)
        k = int(ks[np.argmax(expected / seconds)])
        if self._rng.random() < EXPLORE:
            k += int(self._rng.choice((-1, 1)))
        return min(max(k, 1), k_max)

    def begin(self, prompt: Sequence[int]) -> None:
        self._pending = None
        self.source.begin(prompt)

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator) -> Proposal:
        self.k = self.best_k(k)
        t0 = self._clock()
        p = self.source.propose(context, self.k, sp, rng)
        t1 = self._clock()
        if p.tokens:
            self._t_token = DECAY * self._t_token + (1 - DECAY) * (t1 - t0) / len(p.tokens)
            self._pending = (len(p.tokens), t1)
        return p

    def rewind(self, n_keep: int) -> None:
        self.source.rewind(n_keep)

    def observe(self, n_accepted: int) -> None:
        if self._pending is not None:
            drafted, t1 = self._pending
            self._pending = None
            self.cost.add(drafted + 1, self._clock() - t1)
            self._acc = DECAY * self._acc + n_accepted
            self._trials = DECAY * self._trials + n_accepted + (n_accepted < drafted)
        self.source.observe(n_accepted)

    def end(self) -> None:
        self.source.end()
