"""Sampling fidelity: speculative sampling draws from the target's own distribution.

The target's exact distribution is computed from its logits with the same transforms (temp,
top-k, top-p, min-p), and seeded speculative runs (2,000; 1,000 on the real pair) are compared
with it by chi-square.
Both ways of verifying a sampled draft are checked (--spec-sampling exact and rejection) on
the fake model; on the real pair, rejection (exact draws the target's own sample at every
position: test_exact_sampling checks that its tokens are those of the target alone).
The first token is checked on a real SmolLM2 pair (the F16 target, the Q2_K as its draft:
rejected about half the time, so the residual is sampled); the first three tokens and n-gram
proposals on the fake model (tests/fakes.py), where 2,000 runs take seconds, not minutes,
and where sampling from the wrong residual is shown to fail the same check.
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest
from concurrency import as_tasks
from fakes import FakeModel
from scipy import stats as sst

from specli import verify
from specli.config import SPEC_SAMPLING, DraftParams, ModelParams, SamplingParams
from specli.drafts import ModelDraft, NgramSimple
from specli.engine import Engine
from specli.plan import load, load_slots
from specli.stats import Stats
from specli.verify import sampling_dist

SP = SamplingParams(temp=0.8, top_k=40, top_p=0.95, min_p=0.05)
N_SEEDS = 2000
# the real pair costs ~50 ms a run: 1,000 runs there (the fake model's tests, where the
# residual's mistakes are shown to fail the check, keep 2,000)
N_REAL = 1000

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(f16, q2_k):
    """The F16 target with the Q2_K draft: its first draft is rejected about half the time
    (the Q4_1's was accepted in 965 of 1,000 runs, so its residual was sampled in 35)."""
    e = load(ModelParams(f16), ModelParams(q2_k), DraftParams(n_max=4, sampling="rejection"))
    yield e
    e.close()


@pytest.fixture(params=SPEC_SAMPLING)
def fake(request):
    """A target and a draft that often disagrees with it (acceptance about one half), in
    each way of verifying a sampled draft."""
    return Engine(FakeModel(seed=5), ModelDraft(FakeModel(seed=5, noise=1.5)),
                  DraftParams(n_max=4, sampling=request.param))


def exact_sequences(e: Engine, prompt: list[int], depth: int, sp: SamplingParams = SP,
                    shape=None) -> dict[tuple[int, ...], float]:
    """Enumerate the target's distribution over the next `depth` tokens (its sampling support).
    shape(row, context, prefix): the row as the chain sees it (a transform, a grammar's mask)."""
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == depth:
            out[prefix] = prob
            return
        ctx = [*prompt, *prefix]
        e.target.sync(ctx[:-1])
        row = e.target.decode([ctx[-1]])[0]
        d = sampling_dist(shape(row, ctx, prefix) if shape else row, sp)
        for t, p in zip(d.ids.tolist(), d.probs.tolist(), strict=True):
            if p > 0:
                walk((*prefix, t), prob * p)

    walk((), 1.0)
    return out


def chi_square(observed: Counter, expected_p: dict, n: int) -> float:
    """Goodness of fit, pooling outcomes expected fewer than 5 times into one bin."""
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for key, p in expected_p.items():
        if n * p >= 5:
            obs.append(observed.get(key, 0))
            exp.append(n * p)
        else:
            pool_o += observed.get(key, 0)
            pool_e += n * p
    outside = {k: c for k, c in observed.items() if k not in expected_p}
    assert not outside, f"sampled outside the target's support: {outside}"
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return float(sst.chisquare(obs, exp).pvalue)


def sample_runs(e: Engine, prompt: list[int], n_tokens: int,
                n_seeds: int = N_SEEDS) -> tuple[list, float]:
    runs, drafted, accepted = [], 0, 0
    for seed in range(n_seeds):
        out = e.complete(prompt, n_tokens, SamplingParams(**{**SP.__dict__, "seed": seed}))
        runs.append(tuple(out.tokens))
        drafted, accepted = drafted + out.stats.n_drafted, accepted + out.stats.n_accept
    return runs, accepted / max(drafted, 1)


def first_tokens(e: Engine, prompt: list[int], n_seeds: int) -> tuple[list, float]:
    """The first token of n_seeds seeded generations of two tokens, each stopped after its
    first step (the second is the target's plain decode when the draft was rejected: it has
    nothing to say about the first token), and the first steps' acceptance rate."""
    runs, drafted, accepted = [], 0, 0
    for seed in range(n_seeds):
        stats = Stats()
        gen = e.steps(prompt, 2, SamplingParams(**{**SP.__dict__, "seed": seed}), stats)
        runs.append((next(gen)[0],))
        gen.close()
        drafted, accepted = drafted + stats.n_drafted, accepted + stats.n_accept
    return runs, accepted / max(drafted, 1)


def test_first_token_follows_the_target_distribution(engine):
    """Two tokens a run: the first step drafts one token, and the first token is that draft
    accepted or the residual's sample, as at any draft length (the fake model's tests below
    cover the later positions)."""
    prompt = engine.tokenize("My favourite fruit is")
    exact = exact_sequences(engine, prompt, 1)
    runs, rate = first_tokens(engine, prompt, N_REAL)
    assert 0.05 < rate < 0.99, "the draft must be rejected sometimes for this to test anything"
    assert chi_square(Counter(runs), exact, N_REAL) > 0.01


@pytest.mark.parametrize("n_slots", [4, 8])
def test_first_token_follows_the_target_distribution_in_a_full_batch(f16, q2_k, n_slots):
    """The same check with n_slots server slots sampling at once, half of them on another
    prompt: their drafts and verifications are combined into shared decodes
    (batching.SharedContext), each slot's rows and seeded draws still its own."""
    engines, shared = load_slots(n_slots, ModelParams(f16, n_ctx=256), ModelParams(q2_k),
                                 DraftParams(n_max=4, sampling="rejection"))
    for e in engines:  # the first token drafted, as `run` drafts it (a server's slot takes
        e.first_plain = False  # its first from the target alone, Engine.first_plain)
    try:
        prompts = [engines[0].tokenize("My favourite fruit is"),
                   engines[0].tokenize("The capital of France is")]
        exact = [exact_sequences(engines[0], p, 1) for p in prompts]
        runs: list[list] = [[], []]
        counts = [0, 0]  # drafted, accepted
        lock = threading.Lock()

        def slot(i: int) -> None:
            for seed in range(i, N_REAL, n_slots):
                stats = Stats()
                gen = engines[i].steps(prompts[i % 2], 2, SamplingParams(
                    **{**SP.__dict__, "seed": seed}), stats)
                token = next(gen)[0]
                gen.close()
                with lock:
                    runs[i % 2].append((token,))
                    counts[0] += stats.n_drafted
                    counts[1] += stats.n_accept

        as_tasks(shared[0].sched, slot, n_slots)  # the server's loop: decodes combined
    finally:
        for e in engines:
            e.close()
        for c in shared:
            c.close()
    assert len(runs[0]) + len(runs[1]) == N_REAL
    assert 0.05 < counts[1] / max(counts[0], 1) < 0.99
    for got, want in zip(runs, exact, strict=True):
        assert chi_square(Counter(got), want, len(got)) > 0.01


def test_first_three_tokens_follow_the_target_distribution(fake):
    prompt = fake.tokenize("The three primary colours are red,")
    exact = exact_sequences(fake, prompt, 3)
    runs, rate = sample_runs(fake, prompt, 3)
    assert 0.05 < rate < 0.99
    assert all(len(r) == 3 for r in runs)
    assert chi_square(Counter(runs), exact, N_SEEDS) > 0.01


@pytest.mark.parametrize("sampling", SPEC_SAMPLING)
def test_ngram_proposals_keep_the_target_distribution(sampling):
    """A deterministic proposal x is accepted with probability p(x), else the target samples
    from p without x (q one-hot), or (exact) p's own sample is accepted when it is x: the
    first token still follows the target exactly."""
    target = FakeModel(seed=5)
    e = Engine(target, NgramSimple(size_n=2, size_m=4), DraftParams(n_max=4, sampling=sampling))
    # text that repeats the target's own greedy path, so a match proposes likely tokens
    path = target.greedy(target.tokenize("My favourite fruits are"), 12)
    prompt = [*path, *target.tokenize(" and "), *path[:6]]
    exact = exact_sequences(e, prompt, 1)
    runs, rate = sample_runs(e, prompt, 3)
    assert 0.05 < rate < 0.99
    assert chi_square(Counter(r[:1] for r in runs), exact, N_SEEDS) > 0.01


def test_the_check_catches_sampling_from_the_wrong_residual(monkeypatch):
    """On a rejection the target must sample from norm(max(0, p - q)); sampling from p itself
    over-weights what the draft proposes, and the chi-square check above says so."""
    e = Engine(FakeModel(seed=5), ModelDraft(FakeModel(seed=6)),
               DraftParams(n_max=4, sampling="rejection"))
    monkeypatch.setattr(verify, "residual", lambda p, q, drafted: p)
    prompt = e.tokenize("The three primary colours are red,")
    exact = exact_sequences(e, prompt, 1)
    runs, _ = sample_runs(e, prompt, 3)
    assert chi_square(Counter(r[:1] for r in runs), exact, N_SEEDS) < 0.01
