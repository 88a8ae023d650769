"""Hybrid drafting: several sources in llama.cpp's order of precedence, first proposal wins."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from specli.config import DraftPolicy, SamplingParams
from specli.drafts.base import Decoded, DraftSource, Outcome, Reads
from specli.drafts.tree import Tree

if TYPE_CHECKING:
    from specli.rules import Rules


class Chain(DraftSource):
    """Ask each source in turn (n-gram types before the draft model, as llama.cpp does) and
    verify the first non-empty proposal. A source skipped in a step catches up on the tokens
    it missed the next time it is asked (a model draft feeds them in one batch)."""

    name = "hybrid"
    own_length = True  # each source gets its own k from the policy

    def __init__(self, sources: Sequence[DraftSource]):
        self.sources = list(sources)
        self.model = next((s.model for s in self.sources if s.model is not None), None)
        self._last: DraftSource | None = None  # the source of the last proposal

    def names(self) -> tuple[str, ...]:
        return tuple(n for s in self.sources for n in s.names())

    def begin(self, prompt: Sequence[int]) -> Reads | None:
        reads = Reads()
        for s in self.sources:
            reads = reads | s.begin(prompt)
        return reads

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator, policy: DraftPolicy | None = None,
                rules: Rules | None = None) -> Tree:
        self._last = None
        policy = policy or DraftPolicy()
        for s in self.sources:
            p = s.propose(context, policy.k_for(s.own_length, k), sp, rng, policy, rules)
            if p.tokens:
                self._last = s
                return p
        return Tree()

    def process(self, batch: Decoded) -> None:
        for s in self.sources:
            s.process(batch)

    def accept(self, outcome: Outcome) -> None:
        for s in self.sources:
            s.accept(outcome if s is self._last else outcome.elsewhere())

    def end(self) -> None:
        for s in self.sources:
            s.end()

    def timer(self) -> Callable[[int, float], None] | None:
        return next((t for s in self.sources if (t := s.timer()) is not None), None)
