"""ngram-map-k and ngram-map-k4v on token sequences, written from common/ngram-map.cpp.

Histories use n = 2, m = 3: a draft needs at least 2n + m = 7 tokens before the last one, and a
match may start no later than len - n - m - 2 (its continuation must lie wholly in the past).
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import accepted

from specli.config import SamplingParams
from specli.drafts.ngram_map import NgramMap

SP = SamplingParams(temp=0.0)


def started(history, key_only=True, min_hits=1, n=2, m=3):
    src = NgramMap(n, m, min_hits, key_only=key_only)
    src.begin(history)
    return src


def propose(src, history, k=100):
    return src.propose(history, k, SP, np.random.default_rng(0)).tokens


# (1, 2) at position 1 is followed by 3, 4, 5; the history ends in (1, 2) again
H = [9, 1, 2, 3, 4, 5, 8, 8, 8, 8, 8, 8, 1, 2]


@pytest.mark.parametrize("key_only", [True, False])
def test_proposes_the_m_tokens_after_the_key(key_only):
    src = started(H, key_only)
    p = src.propose(H, 100, SP, np.random.default_rng(0))
    assert p.tokens == [3, 4, 5]
    assert p.source == ("ngram-map-k" if key_only else "ngram-map-k4v") and not p.q


@pytest.mark.parametrize("h,why", [
    ([9, 1, 3, 3, 4, 5, 8, 8, 8, 8, 8, 8, 1, 2], "no match"),
    ([1, 2, 3, 4, 5, 8, 8, 8, 8, 8, 8, 8, 1, 2], "a match at position 0 does not count"),
    ([8, 8, 8, 8, 8, 8, 8, 8, 1, 2, 5, 5, 1, 2], "match at the end: continuation too recent"),
    ([1, 2, 3, 4, 5, 1, 2], "history shorter than 2n + m"),
])
@pytest.mark.parametrize("key_only", [True, False])
def test_edge_cases_propose_nothing(h, why, key_only):
    assert propose(started(h, key_only), h) == [], why


def test_k_truncates_the_draft():
    assert propose(started(H), H, k=2) == [3, 4]


def test_a_key_drafts_no_more_than_was_accepted_last_time():
    src = started(H)
    assert propose(src, H) == [3, 4, 5]
    src.accept(accepted(1))
    assert propose(src, H) == [3]
    src.accept(accepted(0))
    assert propose(src, H) == [], "llama.cpp never drafts again from a key that failed"


def test_newest_match_first_then_the_hash_keeps_it():
    h = [9, 1, 2, 3, 4, 5, 7, 1, 2, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 1, 2]
    src = started([9])
    assert propose(src, h) == [6, 6, 6], "the search goes newest first"
    # a newer occurrence (followed by 8s) does not displace the hashed one
    h += [8, 8, 8, 8, 8, 8, 1, 2]
    assert propose(src, h) == [6, 6, 6]


def test_the_prompt_is_searched_before_the_generated_text():
    h = [9, 1, 2, 3, 4, 5, 7, 1, 2, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 1, 2]
    assert propose(started(h[:12]), h) == [3, 4, 5]


K4V = [9, 1, 2, 3, 4, 5, 7, 1, 2, 3, 4, 5, 7, 7, 7, 7, 1, 2]  # (1, 2) -> (3, 4, 5) twice


def test_k4v_waits_for_min_hits():
    src = started(K4V, key_only=False, min_hits=2)
    assert propose(src, K4V) == [], "first hit: below min-hits"
    assert propose(src, K4V) == [3, 4, 5], "second hit"


def test_k4v_drafts_only_a_dominant_continuation():
    tie = [9, 1, 2, 3, 4, 5, 7, 1, 2, 6, 6, 6, 7, 7, 7, 7, 1, 2]
    assert propose(started(tie, key_only=False), tie) == [], "1 vs 1: no clear favourite"
    two_to_one = [9, 1, 2, 3, 4, 5, 1, 2, 6, 6, 6, 1, 2, 3, 4, 5, 7, 7, 7, 7, 7, 7, 1, 2]
    assert propose(started(two_to_one, key_only=False), two_to_one) == [3, 4, 5]


def test_k4v_proposes_the_favourite_not_the_latest():
    # (3, 4, 5) follows (1, 2) twice and (6, 6, 6) once, most recently
    h = [9, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 6, 6, 6, 7, 7, 7, 7, 7, 7, 1, 2]
    assert propose(started(h, key_only=False), h) == [3, 4, 5]


def test_k4v_keeps_at_most_four_continuations():
    src = started([0], key_only=False)
    h = [9]
    for v in range(5):
        h += [1, 2, 20 + v, 20 + v, 20 + v]
    h += [7] * 6 + [1, 2]
    src.begin(h)
    propose(src, h)
    key = src._keys[(1, 2)]
    assert [v.num for v in key.values] == [1, 1, 1, 1]
    assert sorted(h[v.idx] for v in key.values) == [20, 21, 22, 23]


def test_begin_keeps_what_still_holds_and_forgets_what_changed():
    src = started(H)
    assert propose(src, H) == [3, 4, 5]
    src.accept(accepted(1))
    src.begin(H)  # the same prompt again: the key and its memory still hold
    assert propose(src, H) == [3]
    changed = [9, 1, 2, 3, 4, 5, 6, 6, 6, 6, 6, 6, 1, 2]
    src.begin([5, *changed[1:]])  # the first token changed: every position is suspect
    assert src._keys == {} and src._hash == {}
    assert propose(src, changed) == [3, 4, 5]


def test_a_draft_cut_by_k_and_accepted_whole_keeps_the_longer_memory():
    src = started(H)
    assert propose(src, H, k=2) == [3, 4]
    src.accept(accepted(2))
    assert propose(src, H) == [3, 4, 5], "k, not the key, was the limit"
    src.accept(accepted(1))
    assert propose(src, H) == [3]
