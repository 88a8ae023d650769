"""Hybrid drafting: several sources in llama.cpp's order of precedence, first proposal wins."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from specli.config import DraftPolicy, SamplingParams
from specli.drafts.base import DraftSource, Proposal, rules_kw

if TYPE_CHECKING:
    from specli.rules import Rules


class Chain:
    """Ask each source in turn (n-gram types before the draft model, as llama.cpp does) and
    verify the first non-empty proposal. A source skipped in a step catches up on the tokens
    it missed the next time it is asked (a model draft feeds them in one batch)."""

    name = "hybrid"
    own_length = True  # each source gets its own k from the policy

    def __init__(self, sources: Sequence[DraftSource]):
        self.sources = list(sources)
        self.model = next((s.model for s in self.sources if s.model is not None), None)
        self._last: DraftSource | None = None  # the source of the last proposal

    def begin(self, prompt: Sequence[int]) -> None:
        for s in self.sources:
            s.begin(prompt)

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator, policy: DraftPolicy | None = None,
                rules: Rules | None = None) -> Proposal:
        self._last = None
        policy = policy or DraftPolicy()
        for s in self.sources:
            p = s.propose(context, policy.k_for(s, k), sp, rng, policy, **rules_kw(rules))
            if p.tokens:
                self._last = s
                return p
        return Proposal()

    def rewind(self, n_keep: int) -> None:
        for s in self.sources:
            s.rewind(n_keep)

    def observe(self, n_accepted: int) -> None:
        if self._last is not None:
            self._last.observe(n_accepted)

    def end(self) -> None:
        for s in self.sources:
            s.end()
