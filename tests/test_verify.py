"""The acceptance rules on synthetic distributions (no model): exactness of rejection sampling."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sst

from specli.config import SamplingParams
from specli.verify import Dist, residual, sampling_dist, verify

GREEDY = SamplingParams(temp=0.0)


def rows(*argmaxes: int, n_vocab: int = 16) -> np.ndarray:
    r = np.zeros((len(argmaxes), n_vocab), dtype=np.float32)
    for i, a in enumerate(argmaxes):
        r[i, a] = 5.0
    return r


def test_greedy_accepts_matching_prefix_and_takes_the_target_token_at_the_mismatch():
    r = rows(3, 4, 9, 1)
    assert verify([3, 4, 5], None, r.__getitem__, GREEDY, None) == (2, 9)


def test_greedy_full_acceptance_takes_the_bonus_row():
    r = rows(3, 4, 5, 7)
    assert verify([3, 4, 5], None, r.__getitem__, GREEDY, None) == (3, 7)


def test_empty_proposal_is_a_plain_step():
    assert verify([], None, rows(6).__getitem__, GREEDY, None) == (0, 6)


def test_greedy_reads_only_the_rows_it_needs():
    seen = []
    r = rows(3, 8, 5, 7)
    verify([3, 4, 5], None, lambda i: (seen.append(i), r[i])[1], GREEDY, None)
    assert seen == [0, 1]


def brute_force(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """A straightforward dense reference of llama.cpp's chain: top-k, top-p, min-p, temp."""
    logits = logits.astype(np.float64)
    order = np.argsort(-logits, kind="stable")
    keep = order[: sp.top_k] if sp.top_k > 0 else order
    p = np.exp(logits[keep] - logits[keep].max())
    p /= p.sum()
    cum, n = 0.0, 0
    while n < len(p):
        cum += p[n]
        n += 1
        if cum >= sp.top_p:
            break
    keep, p = keep[:n], p[:n]
    keep = keep[p >= sp.min_p * p[0]]
    z = logits[keep] / sp.temp
    out = np.zeros_like(logits, dtype=np.float64)
    out[keep] = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    return out


@pytest.mark.parametrize("sp", [
    SamplingParams(temp=0.8, top_k=40, top_p=0.95, min_p=0.05),
    SamplingParams(temp=1.3, top_k=0, top_p=1.0, min_p=0.0),
    SamplingParams(temp=0.5, top_k=5, top_p=0.5, min_p=0.0),
    SamplingParams(temp=1.0, top_k=0, top_p=0.9, min_p=0.2),
])
def test_sampling_dist_matches_a_dense_reference(sp):
    logits = np.random.default_rng(1).normal(0, 2, 500).astype(np.float32)
    d = sampling_dist(logits, sp)
    dense = np.zeros(500)
    dense[d.ids] = d.probs
    np.testing.assert_allclose(dense, brute_force(logits, sp), atol=1e-9)


def test_residual_is_the_normalised_positive_part():
    p = Dist(np.array([1, 2, 3]), np.array([0.5, 0.3, 0.2]))
    q = Dist(np.array([2, 1, 7]), np.array([0.6, 0.1, 0.3]))
    r = residual(p, q, 2)
    dense = dict(zip(r.ids.tolist(), r.probs.tolist(), strict=True))
    assert dense == pytest.approx({1: 0.4 / 0.6, 2: 0.0, 3: 0.2 / 0.6})
    one_hot = residual(p, None, 1)
    assert dict(zip(one_hot.ids.tolist(), one_hot.probs.tolist(), strict=True)) == \
        pytest.approx({1: 0.0, 2: 0.6, 3: 0.4})


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_sampling_preserves_the_target_distribution(deterministic):
    """Draft from q (or a fixed token), verify against p: the first emitted token follows p."""
    rng = np.random.default_rng(7)
    sp = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    target_logits = np.log(np.array([0.45, 0.25, 0.15, 0.10, 0.05]))
    draft_logits = np.log(np.array([0.10, 0.20, 0.30, 0.20, 0.20]))
    row = np.stack([target_logits, target_logits])
    q = sampling_dist(draft_logits, sp)
    counts = np.zeros(5)
    n = 40_000
    for _ in range(n):
        x = 2 if deterministic else q.sample(rng)
        n_acc, nxt = verify([x], None if deterministic else [q], row.__getitem__, sp, rng)
        counts[x if n_acc == 1 else nxt] += 1
    _, pvalue = sst.chisquare(counts, n * np.exp(target_logits))
    assert pvalue > 0.001


@pytest.mark.parametrize("top_k", [0, 40])
def test_a_nan_or_infinite_row_is_refused_and_a_masked_one_is_not(top_k):
    from specli.verify import NonFinite, finite_argmax, finite_argmaxes

    sp = SamplingParams(temp=0.8, top_k=top_k)
    rng = np.random.default_rng(0)
    base = rng.normal(size=1000).astype(np.float32)
    for bad in (np.nan, np.inf):
        row = base.copy()
        row[rng.integers(1000)] = bad
        for check in (lambda r: sampling_dist(r, sp, 3), lambda r: finite_argmax(r, 3),
                      lambda r: finite_argmaxes(np.stack([base, r, base]), 3)):
            with pytest.raises(NonFinite) as e:
                check(row)
            assert e.value.row == 3
    with pytest.raises(NonFinite):
        sampling_dist(np.full(1000, -np.inf, dtype=np.float32), sp)
    masked = base.copy()
    masked[:500] = -np.inf  # a grammar or a bias may rule tokens out: that is a usable row
    assert sampling_dist(masked, sp).ids.min() >= 500 and finite_argmax(masked) >= 500
    rows = np.stack([base, masked, -base])
    assert finite_argmaxes(rows) == [finite_argmax(r) for r in rows]
    assert finite_argmaxes(rows[:, :700]) == [finite_argmax(r) for r in rows[:, :700]]


@pytest.mark.parametrize("drafted", [[], [0], [0, 1, 2], [4, 4], [0, 0, 0, 0]])
def test_exact_verification_draws_once_per_emitted_token(drafted):
    """--spec-sampling exact: each position's token is the target's own sample from the
    request's generator, one draw each, so the tokens are those of plain sampling with the
    same seed whatever was drafted (llama-server's property), and q plays no part."""
    sp = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    rows = np.log(np.random.default_rng(3).dirichlet(np.ones(5), size=8))
    q = [sampling_dist(np.zeros(5), sp)] * len(drafted)
    for seed in range(200):
        plain_rng, rng = np.random.default_rng(seed), np.random.default_rng(seed)
        n_acc, nxt = verify(drafted, q, rows.__getitem__, sp, rng, exact=True)
        plain = [sampling_dist(rows[i], sp).sample(plain_rng) for i in range(n_acc + 1)]
        assert plain == [*drafted[:n_acc], nxt]
        assert n_acc == len(drafted) or plain[-1] != drafted[n_acc]
        assert rng.random() == plain_rng.random()  # the same draws consumed
