"""Draftless speculation from the text so far: llama.cpp's n-gram family (common/ngram-map.cpp)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from specli.config import DraftPolicy, SamplingParams
from specli.drafts.base import DraftSource, Outcome
from specli.drafts.tree import Tree

if TYPE_CHECKING:
    from specli.rules import Rules


class NgramSimple(DraftSource):
    """llama.cpp's ngram-simple: find the most recent earlier occurrence of the last n tokens
    and propose the (up to m) tokens that followed it.

    As in llama.cpp: no draft before the history is longer than n + m + 2 tokens, a match at
    position 0 does not count, and a continuation shorter than n is not proposed. The search is
    an index of every n-gram by its latest start, kept up to date as tokens are committed, so a
    step costs O(new tokens) instead of a scan of the history.
    """

    name = "ngram-simple"
    own_length = True  # drafts up to its m

    def __init__(self, size_n: int = 12, size_m: int = 48):
        self.size_n, self.size_m = size_n, size_m
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 1  # n-grams starting before this position are in the index

    def begin(self, prompt: Sequence[int]) -> None:
        self._index.clear()
        self._indexed = 1

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator, policy: DraftPolicy | None = None,
                rules: Rules | None = None) -> Tree:
        n, m = self.size_n, self.size_m
        cur_len = len(context) - 1  # llama.cpp's history excludes the last sampled token
        if cur_len <= n + m + 1:
            return Tree()
        last_start = cur_len - n - 1  # the current n-gram itself is never a match
        for j in range(self._indexed, last_start + 1):
            self._index[tuple(context[j:j + n])] = j
        self._indexed = max(self._indexed, last_start + 1)
        match = self._index.get(tuple(context[-n:]))
        if match is None:
            return Tree()
        copy_max = min(m, cur_len - (match + n))
        if copy_max < n:
            return Tree()
        start = match + n
        return Tree.chain(context[start:start + min(copy_max, k)], source=self.name)

    # accept: nothing (only committed tokens are indexed; a rewind never reaches them)


_MOD_MUL = 6364136223846793005
_MASK64 = (1 << 64) - 1


class NgramMod(DraftSource):
    """llama.cpp's ngram-mod: a fixed-size pool (4M slots) mapping the hash of an n-gram
    (n = n_match) to the token that last followed it; a draft chains lookups from the last n
    tokens, up to n_max, and is dropped if it stops before n_min.

    As in llama.cpp the pool outlives a generation (later prompts draft from earlier text), is
    reset when it is more than a quarter full at `begin`, and after five consecutive drafts
    with less than a quarter of their tokens accepted. New n-grams are added in chunks of 32.
    """

    name = "ngram-mod"
    own_length = True  # drafts up to its n_max
    POOL_SIZE = 4 * 1024 * 1024
    EMPTY = -1

    def __init__(self, n_match: int = 24, n_max: int = 64, n_min: int = 48,
                 pool_size: int = POOL_SIZE):
        self.n, self.n_max, self.n_min = n_match, n_max, n_min
        self.pool = np.full(pool_size, self.EMPTY, dtype=np.int32)
        self.used = 0
        self._i_last = 0  # history positions before this have their n-grams in the pool
        self._n_draft_last = 0
        self._n_low = 0

    def _idx(self, tokens: Sequence[int]) -> int:
        res = 0
        for t in tokens:
            res = (res * _MOD_MUL + t) & _MASK64
        return res % self.pool.size

    def _add(self, history: Sequence[int], i: int) -> None:
        j = self._idx(history[i:i + self.n])
        if self.pool[j] == self.EMPTY:
            self.used += 1
        self.pool[j] = history[i + self.n]

    def reset(self) -> None:
        self.pool.fill(self.EMPTY)
        self.used = 0

    def begin(self, prompt: Sequence[int]) -> None:
        self._i_last = self._n_draft_last = 0
        prompt = prompt[:-1]  # llama.cpp begins with the prompt minus its last token
        if len(prompt) < self.n:
            return
        for i in range(len(prompt) - self.n):
            self._add(prompt, i)
        self._i_last = len(prompt) - self.n
        if self.used / self.pool.size > 0.25:
            self.reset()

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator, policy: DraftPolicy | None = None,
                rules: Rules | None = None) -> Tree:
        n = self.n
        self._n_draft_last = 0
        cur_len = len(context) - 1  # llama.cpp's history excludes the last sampled token
        if cur_len < n:
            return Tree()
        if self._i_last + 32 < cur_len:
            for i in range(self._i_last, cur_len - n):
                self._add(context, i)
            self._i_last = cur_len - n
        window = list(context[-n:])
        drafted: list[int] = []
        for i in range(self.n_max):
            token = int(self.pool[self._idx(window[i:i + n])])
            if token == self.EMPTY:
                if i < self.n_min:
                    return Tree()
                break
            window.append(token)
            drafted.append(token)
        self._n_draft_last = len(drafted)
        return Tree.chain(drafted[:k], source=self.name)

    def accept(self, outcome: Outcome) -> None:
        """Only committed tokens enter the pool (a rewind never reaches them); a verified
        proposal counts towards the reset."""
        if outcome.tree is not None and self._n_draft_last > 0:
            if outcome.n_accepted / self._n_draft_last < 0.25:
                self._n_low += 1
                if self._n_low >= 5:
                    self.reset()
                    self._n_low = 0
                    self._i_last = 0
            else:
                self._n_low = 0
