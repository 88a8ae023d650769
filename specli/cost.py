"""The one cost model of speculative decoding on this machine, after Leviathan et al.

A step that drafts k tokens costs k·c (the draft, per token) plus v(k + 1) (the target
verifying k + 1 tokens) and yields E(k) = 1 + S(1) + ... + S(k) tokens, where S(j) is the
chance that the first j drafted tokens are all accepted; the target alone costs v(1) a token.
tune-draft and check-pair --probe fill it from measured runs or timed decodes (tuning.py);
--draft auto fills it online and picks k each step (drafts/adaptive.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where it computes: check-pair and --help load none
    import numpy as np


def expected_tokens(s: Sequence[float], k: int) -> float:
    """E(k) = 1 + S(1) + ... + S(k); positions never measured count as never accepted."""
    return 1.0 + sum(s[:k])


@dataclass(frozen=True)
class CostModel:
    """Seconds on this machine: the draft's per drafted token (c), the target's to verify a
    batch of n tokens (v[n - 1], n = 1..k+1), and Python's overhead per step and per token
    of the target alone."""

    c: float
    v: tuple[float, ...]
    overhead_step: float = 0.0
    overhead_token: float = 0.0

    @classmethod
    def line(cls, c: float, t1: float, slope: float, k_max: int) -> CostModel:
        """Verification as a line: v(n) = t1 · (1 + slope · (n - 1)), for n = 1..k_max+1."""
        return cls(c, tuple(t1 * (1 + slope * n) for n in range(k_max + 1)))

    def speedup(self, s: Sequence[float], k: int) -> float:
        """E[accepted + 1] tokens per step for k·c + v(k + 1) seconds, against v(1) seconds
        per token for the target alone. s[j - 1] = S(j)."""
        if k == 0:
            return 1.0
        step = k * self.c + self.v[min(k, len(self.v) - 1)] + self.overhead_step
        per_token = self.v[0] + self.overhead_token
        return expected_tokens(s, k) * per_token / step if step > 0 else 0.0

    def speedups(self, s: np.ndarray) -> np.ndarray:
        """speedup(s, k) for k = 1..len(s) at once (the per-step choice of --draft auto)."""
        import numpy as np

        ks = np.arange(1, len(s) + 1)
        v = np.asarray(self.v)[np.minimum(ks, len(self.v) - 1)]
        step = ks * self.c + v + self.overhead_step
        return (1.0 + np.cumsum(s)) * (self.v[0] + self.overhead_token) / step
