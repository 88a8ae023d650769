"""llama.cpp's ngram-map-k and ngram-map-k4v (common/ngram-map.cpp): a map from key n-grams to
the m-grams that followed them, with per-key hit counts and per-value acceptance memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from specli.config import DraftPolicy, SamplingParams
from specli.drafts.base import DraftSource, Outcome
from specli.drafts.tree import Tree

if TYPE_CHECKING:
    from specli.rules import Rules

MAX_VALUES = 4  # COMMON_NGRAM_MAX_VALUES: continuations remembered per key
MAX_COUNT = 16380  # COMMON_NGRAM_MAX_VALUE_COUNT
HASH_SLOTS = 262144  # COMMON_NGRAM_HASH_MAP_SIZE
_LCG = 2654435761  # llama.cpp's 32-bit LCG factor for the key hash


@dataclass
class _Value:
    idx: int = 0  # where this m-gram starts in the history (0: unused slot)
    num: int = 0  # how often it followed the key
    n_accepted: int = 0  # tokens the target accepted the last time it was drafted


@dataclass
class _Key:
    idx: int  # where the key n-gram occurs in the history
    values: list[_Value]
    stat_idx: int = 0  # occurrences before this position are counted in `values`
    num: int = 0  # how often the key was looked up


class NgramMap(DraftSource):
    """A key n-gram (the last n tokens) is looked up through a hash of earlier n-grams to their
    positions; ngram-map-k drafts the m tokens that followed it, ngram-map-k4v counts up to four
    different continuations once the key has been seen `min_hits` times, and drafts the most
    frequent one when it occurs at least twice as often as all the others together.

    As in llama.cpp, a value drafts no more tokens than the target accepted the last time it
    was drafted (m at first), the hash keeps a key's earliest indexed position, and positions
    within n + m of the start of generation are not indexed. Two deliberate differences: k4v
    drafts the chosen value's own tokens (llama.cpp copies those after the latest match, which
    need not be the value it chose), and a draft that k cut short and the target accepted whole
    does not shrink the value's memory (llama.cpp never cuts n-gram drafts).
    """

    own_length = True  # drafts up to its m

    def __init__(self, size_n: int = 12, size_m: int = 48, min_hits: int = 1,
                 key_only: bool = True):
        self.n, self.m, self.min_hits, self.key_only = size_n, size_m, min_hits, key_only
        self.name = "ngram-map-k" if key_only else "ngram-map-k4v"
        self._keys: dict[tuple[int, ...], _Key] = {}
        self._hash: dict[int, int] = {}  # key_map: hash slot -> history position
        self._hash_last = 0  # key_map_last_idx: positions above it are not hashed yet
        self._begin = 0  # size_last_begin: history length when generation began
        self._history: Sequence[int] = ()  # the history positions refer to
        # key and value of the last draft, its length, and whether k (not the value's memory)
        # cut it short
        self._last: tuple[_Key, int, int, bool] | None = None

    def _slot(self, tokens: Sequence[int], start: int) -> int:
        h = 0
        for t in tokens[start:start + self.n]:
            h = (h * _LCG + t) & 0xFFFFFFFF
        return h % HASH_SLOTS

    def begin(self, prompt: Sequence[int]) -> None:
        tokens = prompt[:-1]  # llama.cpp begins with the prompt minus its last token
        old = self._history
        keep = 0
        for a, b in zip(old, tokens, strict=False):
            if a != b:
                break
            keep += 1
        if keep < len(old):
            # the history changed after `keep`: forget what was learnt past the start of the
            # last generation (llama.cpp's rule) and anything touching a changed token
            self._forget(min(self._begin, max(0, keep - self.n - self.m)))
        self._begin = len(tokens)
        self._history = tokens

    def _forget(self, cut: int) -> None:
        self._hash = {s: i for s, i in self._hash.items() if i < cut}
        self._hash_last = cut - 1 if cut > 0 else 0
        for key_tokens, key in list(self._keys.items()):
            if key.idx >= cut:
                del self._keys[key_tokens]
                continue
            if self.key_only:
                continue
            kept = [v for v in key.values if v.idx != 0 and v.idx < cut]
            if not kept:
                del self._keys[key_tokens]
                continue
            key.values = kept + [_Value() for _ in range(MAX_VALUES - len(kept))]
        self._last = None

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator, policy: DraftPolicy | None = None,
                rules: Rules | None = None) -> Tree:
        self._last = None
        self._history = context
        n, m = self.n, self.m
        cur_len = len(context) - 1  # llama.cpp's history excludes the last sampled token
        if cur_len < 2 * n + m:
            return Tree()
        key_tokens = tuple(context[-n:])
        top = cur_len - n - m - 1  # the highest position a match may have
        match = self._hash.get(self._slot(key_tokens, 0), 0)
        if not (0 < match < top and tuple(context[match:match + n]) == key_tokens):
            match = self._search(context, key_tokens, top)
        self._index(context, top)
        if match == 0:
            return Tree()

        key = self._keys.get(key_tokens)
        if key is None:
            key = self._keys[key_tokens] = _Key(
                match, [_Value(n_accepted=m) for _ in range(MAX_VALUES)])
        key.num = min(key.num + 1, MAX_COUNT)
        if self.key_only:
            return self._draft(key, 0, match + n, k)
        if key.num < self.min_hits:
            return Tree()
        self._count_values(context, key, key_tokens, match)
        counts = [v.num for v in key.values]
        best = counts.index(max(counts))
        others = sum(counts) - counts[best]
        if others > 0 and counts[best] < 2 * others:
            return Tree()  # no continuation clearly dominates
        return self._draft(key, best, key.values[best].idx, k)

    def _unindexed(self, top: int) -> list[range]:
        """The positions not yet hashed, newest first, in llama.cpp's two ranges: the prompt's
        (up to n + m before its end), then the generated text's."""
        n, m = self.n, self.m
        ranges = []
        if self._begin > n + m + 1:
            ranges.append(range(self._begin - n - m - 1, self._hash_last, -1))
        ranges.append(range(top, max(self._begin, self._hash_last), -1))
        return ranges

    def _search(self, context: Sequence[int], key_tokens: tuple[int, ...], top: int) -> int:
        for r in self._unindexed(top):
            for j in r:
                if tuple(context[j:j + self.n]) == key_tokens:
                    return j
        return 0

    def _index(self, context: Sequence[int], top: int) -> None:
        for r in self._unindexed(top):
            for j in r:
                self._hash.setdefault(self._slot(context, j), j)  # collisions keep the first
        self._hash_last = max(top, self._hash_last)

    def _count_values(self, context: Sequence[int], key: _Key, key_tokens: tuple[int, ...],
                      match: int) -> None:
        n, m = self.n, self.m
        for i in range(key.stat_idx, match + 1):
            if tuple(context[i:i + n]) != key_tokens:
                continue
            start = i + n
            for v in key.values:
                if v.idx == 0:  # a new continuation in a free slot
                    v.idx, v.num, v.n_accepted = start, 0, m
                elif context[start:start + m] != context[v.idx:v.idx + m]:
                    continue
                v.num = min(v.num + 1, MAX_COUNT)
                break
        key.stat_idx = match

    def _draft(self, key: _Key, value: int, start: int, k: int) -> Tree:
        n_own = min(self.m, key.values[value].n_accepted)
        n_draft = min(n_own, k)
        self._last = (key, value, n_draft, n_draft < n_own)
        return Tree.chain(self._history[start:start + n_draft], source=self.name)

    def accept(self, outcome: Outcome) -> None:
        """Positions refer to committed tokens only (a rewind never reaches them); a verified
        proposal's accepted length is remembered for its key."""
        if outcome.tree is not None and self._last is not None:
            n_accepted = outcome.n_accepted
            key, value, n_draft, cut_by_k = self._last
            # a draft that k cut short and the target accepted whole says nothing against the
            # longer one (llama.cpp never cuts n-gram drafts, so it has no such case)
            if not (cut_by_k and n_accepted == n_draft):
                key.values[value].n_accepted = n_accepted
