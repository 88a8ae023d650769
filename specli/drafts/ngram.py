"""Draftless speculation from the text so far: llama.cpp's n-gram family (common/ngram-map.cpp)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specli.config import SamplingParams
from specli.drafts.base import Proposal


class NgramSimple:
    """llama.cpp's ngram-simple: find the most recent earlier occurrence of the last n tokens
    and propose the (up to m) tokens that followed it.

    As in llama.cpp: no draft before the history is longer than n + m + 2 tokens, a match at
    position 0 does not count, and a continuation shorter than n is not proposed. The search is
    an index of every n-gram by its latest start, kept up to date as tokens are committed, so a
    step costs O(new tokens) instead of a scan of the history.
    """

    name = "ngram-simple"

    def __init__(self, size_n: int = 12, size_m: int = 48):
        self.size_n, self.size_m = size_n, size_m
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 1  # n-grams starting before this position are in the index

    def begin(self, prompt: Sequence[int]) -> None:
        self._index.clear()
        self._indexed = 1

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator) -> Proposal:
        n, m = self.size_n, self.size_m
        cur_len = len(context) - 1  # llama.cpp's history excludes the last sampled token
        if cur_len <= n + m + 1:
            return Proposal()
        last_start = cur_len - n - 1  # the current n-gram itself is never a match
        for j in range(self._indexed, last_start + 1):
            self._index[tuple(context[j:j + n])] = j
        self._indexed = max(self._indexed, last_start + 1)
        match = self._index.get(tuple(context[-n:]))
        if match is None:
            return Proposal()
        copy_max = min(m, cur_len - (match + n))
        if copy_max < n:
            return Proposal()
        start = match + n
        return Proposal(list(context[start:start + min(copy_max, k)]), source=self.name)

    def rewind(self, n_keep: int) -> None:
        """Only committed tokens are indexed; a rewind never reaches them."""

    def observe(self, n_accepted: int) -> None:
        pass
