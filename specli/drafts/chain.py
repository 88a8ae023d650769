"""Hybrid drafting: several sources in llama.cpp's order of precedence, first proposal wins."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specli.config import SamplingParams
from specli.drafts.base import DraftSource, Proposal


class Chain:
    """Ask each source in turn (n-gram types before the draft model, as llama.cpp does) and
    verify the first non-empty proposal. A source skipped in a step catches up on the tokens
    it missed the next time it is asked (a model draft feeds them in one batch)."""

    name = "hybrid"

    def __init__(self, sources: Sequence[DraftSource]):
        self.sources = list(sources)
        self._last: DraftSource | None = None  # the source of the last proposal

    def begin(self, prompt: Sequence[int]) -> None:
        for s in self.sources:
            s.begin(prompt)

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator) -> Proposal:
        self._last = None
        for s in self.sources:
            p = s.propose(context, k, sp, rng)
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


class Capped:
    """A source asked for at most n_max tokens per step: `--draft K` given explicitly on an
    n-gram type, which otherwise drafts up to its own m, as in llama.cpp."""

    def __init__(self, source: DraftSource, n_max: int):
        self.source, self.n_max, self.name = source, n_max, source.name

    def begin(self, prompt: Sequence[int]) -> None:
        self.source.begin(prompt)

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator) -> Proposal:
        return self.source.propose(context, min(k, self.n_max), sp, rng)

    def rewind(self, n_keep: int) -> None:
        self.source.rewind(n_keep)

    def observe(self, n_accepted: int) -> None:
        self.source.observe(n_accepted)

    def end(self) -> None:
        self.source.end()
