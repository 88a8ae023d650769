"""The n-gram draft sources on token sequences, checked against llama.cpp's rules."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import accepted

from specli.config import SamplingParams
from specli.drafts.ngram import NgramSimple

SP = SamplingParams(temp=0.0)


def naive_ngram_simple(history: list[int], n: int, m: int) -> list[int]:
    """A literal transcription of common_ngram_simple_draft (tokens + sampled = history)."""
    tokens, sampled = history[:-1], history[-1]
    cur_len = len(tokens)
    if cur_len <= n + m + 1:
        return []
    pattern = tokens[cur_len - n + 1:] + [sampled]
    match_pos = 0
    for j in range(cur_len - n - 1, 0, -1):
        if tokens[j:j + n] == pattern:
            match_pos = j
            break
    if match_pos == 0:
        return []
    copy_max = min(m, cur_len - (match_pos + n))
    if copy_max < n:
        return []
    return tokens[match_pos + n:match_pos + n + copy_max]


def propose(src, history, k=100):
    return src.propose(history, k, SP, np.random.default_rng(0)).tokens


def test_proposes_what_followed_the_latest_earlier_occurrence():
    n, m = 2, 3
    h = [9, 9, 1, 2, 7, 7, 7, 5, 1, 2, 3, 4, 5, 6, 8, 1, 2]
    src = NgramSimple(n, m)
    src.begin(h)
    assert propose(src, h) == naive_ngram_simple(h, n, m) == [3, 4, 5]


@pytest.mark.parametrize("h,why", [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2], "too short for n + m + 2"),
    ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], "no match"),
    ([1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2], "match only at position 0"),
    ([7, 8, 9, 3, 4, 5, 6, 0, 0, 1, 2, 3, 0, 1, 2, 1, 2], "latest match leaves < n tokens"),
])
def test_edge_cases_propose_nothing(h, why):
    src = NgramSimple(2, 3)
    src.begin(h)
    assert propose(src, h) == naive_ngram_simple(h, 2, 3) == [], why


def test_k_truncates_the_continuation():
    h = [9, 9, 1, 2, 3, 4, 5, 6, 8, 8, 8, 1, 2]
    src = NgramSimple(2, 3)
    src.begin(h)
    assert propose(src, h, k=2) == [3, 4]


def test_incremental_index_matches_the_literal_search_on_random_histories():
    rng = np.random.default_rng(3)
    for n, m in [(2, 3), (3, 8), (1, 4)]:
        h = [int(t) for t in rng.integers(0, 4, 30)]
        src = NgramSimple(n, m)
        src.begin(h[:1])
        for _ in range(300):
            assert propose(src, h) == naive_ngram_simple(h, n, m)
            h.append(int(rng.integers(0, 4)))


GROUNDED = [  # the answer repeats its input: what n-gram drafts are for
    "Repeat the following Python function exactly, then add a docstring to it:\n\n"
    "def moving_average(values, window):\n    if window <= 0:\n"
    "        raise ValueError(\"window must be positive\")\n    result = []\n    total = 0.0\n"
    "    for i, v in enumerate(values):\n        total += v\n        if i >= window:\n"
    "            total -= values[i - window]\n        if i >= window - 1:\n"
    "            result.append(total / window)\n    return result",
    "Rename the variable `cnt` to `count` in this code and print the whole result:\n\n"
    "cnt = 0\nfor line in open('data.txt'):\n    if line.strip():\n        cnt += 1\n"
    "print('non-empty lines:', cnt)\nif cnt > 100:\n    print('that is a lot of lines')\n",
]


KINDS = {  # name: (spec types, extra NgramParams, draft model?, --draft auto?)
    "ngram-simple": (["ngram-simple"], {}, False, False),
    "ngram-map-k": (["ngram-map-k"], {}, False, False),
    "ngram-map-k4v": (["ngram-map-k4v"], {}, False, False),
    # shorter than llama.cpp's 24/48 so that the short rename prompt drafts too
    "ngram-mod": (["ngram-mod"], {"mod_n_match": 8, "mod_n_min": 4}, False, False),
    "ngram-cache": (["ngram-cache"], {}, False, False),
    "hybrid": (["ngram-simple", "draft-simple"], {}, True, False),
    "ngram-simple auto": (["ngram-simple"], {}, False, True),
    "hybrid auto": (["ngram-map-k", "draft-simple"], {}, True, True),
}


@pytest.fixture(scope="module")
def engines(f16, q4_1):
    """One target model shared by an engine per kind (what Engine.load builds, minus reloading
    the weights each time)."""
    from specli.backend import Model
    from specli.config import DRAFT_AUTO_MAX, DraftParams, ModelParams, NgramParams
    from specli.drafts import ModelDraft
    from specli.engine import Engine
    from specli.plan import combine, ngram_drafts

    target = Model(ModelParams(f16))
    draft_model = Model(ModelParams(q4_1))
    made = {}
    for kind, (types, extra, with_model, auto) in KINDS.items():
        dp = DraftParams(n_max=DRAFT_AUTO_MAX, adaptive=True) if auto else DraftParams()
        sources = ngram_drafts(types, NgramParams(**extra), target.n_vocab)
        if with_model:
            sources.append(ModelDraft(draft_model, n_vocab_target=target.n_vocab))
        made[kind] = Engine(target, combine(sources, auto), dp)
    yield made
    target.close()
    draft_model.close()


@pytest.fixture(scope="module")
def plains() -> dict:
    """Each prompt's plain greedy run on the shared target, made once."""
    return {}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("prompt", GROUNDED)
def test_greedy_ngram_drafting_equals_plain(engines, plains, kind, prompt):
    e = engines[kind]
    ids = e.tokenize(prompt, chat=True)
    if prompt not in plains:  # the same target, greedy: one plain run serves every kind
        plains[prompt] = e.complete(ids, 160, SP, speculative=False)
    plain = plains[prompt]
    fast = e.complete(ids, 160, SP)
    assert fast.tokens == plain.tokens
    ngram = fast.stats.per_source[KINDS[kind][0][0]]
    assert ngram["gen_tokens"] > 0 and ngram["acc_tokens"] > 0
    if kind == "hybrid":
        assert fast.stats.per_source["draft"]["gen_tokens"] > 0


def test_ngram_proposals_are_deterministic_at_any_temperature():
    """An n-gram proposal carries no q, so verify treats it as one-hot (accept x with p(x));
    test_verify and test_sampling check that rule statistically."""
    src = NgramSimple(2, 3)
    h = [9, 9, 1, 2, 3, 4, 5, 6, 8, 8, 8, 1, 2]
    src.begin(h)
    p = src.propose(h, 8, SamplingParams(temp=0.8), np.random.default_rng(0))
    assert p.tokens == [3, 4, 5] and not p.q and p.source == "ngram-simple"


def literal_mod_idx(tokens, size):
    res = 0
    for t in tokens:
        res = (res * 6364136223846793005 + t) % 2**64
    return res % size


def test_ngram_mod_hash_is_llama_cpps():
    from specli.drafts.ngram import NgramMod

    m = NgramMod(n_match=3, pool_size=1000)
    assert m._idx([5, 7, 11]) == literal_mod_idx([5, 7, 11], 1000)
    assert m._idx([49151, 0, 3]) == literal_mod_idx([49151, 0, 3], 1000)


def mod_history():
    # a phrase seen in the prompt, then generation restarting it
    phrase = list(range(100, 112))
    return [1, 2, 3, *phrase, 4, 5, *phrase[:3]]


def test_ngram_mod_chains_lookups_from_the_pool():
    from specli.drafts.ngram import NgramMod

    h = mod_history()
    m = NgramMod(n_match=3, n_max=6, n_min=2, pool_size=4096)
    m.begin(h[:17])  # the prompt: everything up to and including the phrase and 4, 5
    assert propose(m, h) == [103, 104, 105, 106, 107, 108]
    assert propose(m, h, k=2) == [103, 104]


def test_ngram_mod_edge_cases():
    from specli.drafts.ngram import NgramMod

    h = mod_history()
    # stops before n_min: nothing; no match at all: nothing; history shorter than n: nothing
    m = NgramMod(n_match=3, n_max=64, n_min=12, pool_size=4096)
    m.begin(h[:17])
    assert propose(m, h) == []
    m = NgramMod(n_match=3, n_max=6, n_min=2, pool_size=4096)
    m.begin(h[:17])
    assert propose(m, [*h[:17], 9, 9, 9]) == []
    assert propose(NgramMod(n_match=3, pool_size=64), [1, 2]) == []


def test_ngram_mod_pool_resets():
    from specli.drafts.ngram import NgramMod

    # more than a quarter full at begin: reset
    m = NgramMod(n_match=2, n_max=4, n_min=1, pool_size=16)
    m.begin(list(range(40)))
    assert m.used == 0
    # five drafts in a row with under a quarter accepted: reset
    h = mod_history()
    m = NgramMod(n_match=3, n_max=6, n_min=2, pool_size=4096)
    m.begin(h[:17])
    for i in range(5):
        assert propose(m, h), f"draft {i}"
        m.accept(accepted(0))
    assert m.used == 0 and propose(m, h) == []
