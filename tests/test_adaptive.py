"""--draft auto: the cost fit and the choice of k, on a fake source and fake timings."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import accepted

from specli.config import SamplingParams
from specli.cost import CostModel
from specli.drafts.adaptive import Adaptive, Batch, VerifyCost, plan_batch
from specli.drafts.base import DraftSource
from specli.drafts.tree import Tree

SP = SamplingParams(temp=0.0)


class Echo(DraftSource):
    """Proposes k copies of a token; records the k it was asked for."""

    name = "echo"

    def __init__(self):
        self.asked: list[int] = []
        self.observed: list[int] = []

    def propose(self, context, k, sp, rng, policy=None, rules=None):
        self.asked.append(k)
        return Tree.chain([7] * k, source=self.name)

    def accept(self, outcome):
        self.observed.append(outcome.n_accepted)


def test_cost_fit_recovers_a_linear_batch_cost():
    c = VerifyCost()
    for n in [1, 3, 5, 9, 2, 7, 4, 6] * 5:
        c.add(n, 0.010 * (1 + 0.25 * (n - 1)))
    a, slope = c.fit()
    assert a == pytest.approx(0.010, rel=0.05) and slope == pytest.approx(0.25, rel=0.1)


def test_cost_fit_falls_back_on_the_prior_slope_without_variety():
    c = VerifyCost()
    for _ in range(20):
        c.add(5, 0.02)
    a, slope = c.fit()
    assert 0.1 < slope < 0.5 and a * (1 + slope * 4) == pytest.approx(0.02, rel=0.05)


class Slow(Echo):
    """Echo whose drafting costs `c` seconds a token on a fake clock."""

    def __init__(self, now: list[float], c: float):
        super().__init__()
        self.now, self.c = now, c

    mute = 0  # the first steps propose nothing (an n-gram source before its first match)

    def propose(self, context, k, sp, rng, policy=None, rules=None):
        if self.mute:
            self.mute -= 1
            return Tree()
        self.now[0] += self.c * k
        return super().propose(context, k, sp, rng, policy, rules)


def simulate(acceptance: float, steps: int = 200, slope: float = 0.3,
             all_or_nothing: bool = False, c: float = 0.0, cost=None,
             measured: VerifyCost | None = None, mute: int = 0,
             catch_up: float | None = None) -> list[int]:
    """Drive Adaptive with a geometric acceptance and a known verification cost (a fake
    clock that advances by the cost of each verification batch, cost(n) seconds for n
    tokens where given, and by c a drafted token); `measured`: the cost as already measured
    (by another source of a chain), `mute`: the first steps the source proposes nothing,
    `catch_up`: the source misses the plain steps (a draft model) and catches up on them
    at that many seconds a token."""
    rng = np.random.default_rng(1)
    now = [0.0]
    src = Slow(now, c) if catch_up is None else Behind(now, c, 0, catch_up)
    src.mute = mute
    ad = Adaptive(src, measured or VerifyCost(), seed=0, clock=lambda: now[0])
    ks = []
    for _ in range(steps):
        p = ad.propose([1, 2, 3], 64, SP, rng)
        n_acc = 0
        if all_or_nothing:
            n_acc = len(p.tokens) if rng.random() < acceptance else 0
        while not all_or_nothing and n_acc < len(p.tokens) and rng.random() < acceptance:
            n_acc += 1
        dt = cost(len(p.tokens) + 1) if cost else 0.01 * (1 + slope * len(p.tokens))
        now[0] += dt
        ad.accept(accepted(n_acc))
        ad.timer()(len(p.tokens) + 1, dt)  # as the engine times each step, plain ones too
        if catch_up is not None:
            src.n += ad.k == 0
        ks.append(ad.k)
    return ks


def test_k_grows_with_acceptance_and_shrinks_without_it():
    low, high = simulate(0.2), simulate(0.95)
    assert np.mean(low[-50:]) <= 2
    assert np.mean(high[-50:]) >= 5
    # E(k)/cost(k) for a = 0.95 and slope 0.3 is flat from k = 6 to 9 (within 2%), not 64
    assert max(high[-50:]) < 20


def test_a_source_that_is_right_all_the_way_or_not_at_all_gets_long_drafts():
    """An n-gram match is usually accepted whole or rejected at once: per-position rates see
    that the 20th token is as safe as the 2nd, where a per-token rate would stop early."""
    ks = simulate(0.8, slope=0.1, all_or_nothing=True)
    assert np.mean(ks[-50:]) >= 24


def test_k_never_exceeds_what_the_engine_allows():
    src = Echo()
    ad = Adaptive(src, VerifyCost())
    for cap in [1, 2, 3]:
        ad.propose([1], cap, SP, np.random.default_rng(0))
        assert src.asked[-1] <= cap


def test_observe_is_forwarded_and_the_timer_feeds_the_cost():
    """Alone (`run`), each step's verification is timed into the source's cost through its
    timer (the engine's calls: test_loop); a server slot's decodes are timed by the shared
    context that makes them, and it has none."""
    src = Echo()
    ad = Adaptive(src, VerifyCost())
    ad.propose([1], 4, SP, np.random.default_rng(0))
    ad.accept(accepted(0))
    assert src.observed == [0] and ad.acceptance < 0.6
    ad.timer()(3, 0.02)
    assert ad.cost._w == 1 and ad.cost.at(3) == pytest.approx(0.02)
    assert Adaptive(Echo(), batch=Batch(), who="me").timer() is None


def test_a_plain_step_is_priced_as_measured_not_off_the_verifications_line():
    """llama.cpp decodes one token with matrix-vector kernels and a batch with matrix
    products: on the F16 SmolLM2 a plain step costs far less than the line through the
    verifications says at n = 1 (it read t(1) 1.4-1.6x too dear, and drafting looked to
    win where it lost, 0.67-0.83x). Priced as timed, a draft right 60% of the time decodes
    plainly; one right 95% of the time still drafts; on a linear cost the first drafts."""
    def jump(n: int) -> float:
        return 0.010 if n == 1 else 0.016 * (1 + 0.1 * (n - 1))

    loses = simulate(0.6, c=0.001, cost=jump)
    assert sum(k == 0 for k in loses[-100:]) >= 85, loses[-100:]
    wins = simulate(0.95, c=0.001, cost=jump)
    assert np.mean(wins[-100:]) >= 4, wins[-100:]
    line = simulate(0.6, c=0.001, cost=lambda n: 0.016 * (1 + 0.1 * (n - 1)))
    assert sum(k == 0 for k in line[-100:]) <= 10, line[-100:]


def test_a_plain_step_is_timed_again_now_and_then_while_drafting():
    """Plain steps timed 2x too dear (the machine busy for a moment) made drafting look
    better than it is, and a draft that always drafts never timed another: one is timed
    again once 4% of the verifications' time since the last has earned it, and a decode of
    one token costs the median of the last 5 timed."""
    def jump(n: int) -> float:
        return 0.010 if n == 1 else 0.016 * (1 + 0.1 * (n - 1))

    measured = VerifyCost()
    for _ in range(5):
        measured.add(1, 0.020)
    loses = simulate(0.6, c=0.001, cost=jump, measured=measured)
    assert sum(k == 0 for k in loses[-100:]) >= 85, loses[-100:]


def test_a_free_draft_of_unknown_cost_is_planned_at_its_full_length():
    """On the F16 SmolLM2 (one thread) a verification of 3 tokens costs 3x a plain step and
    one of 9 tokens 4.8x: a short draft never pays, a long right one does. A draft of
    unknown cost drafts 2 tokens first, but is planned at its full length: planned at 2, an
    n-gram source never drafted (the hybrid --draft auto of test_ngram: the chain's draft
    model had timed a verification of 3 before the n-gram's first match), and never learnt
    that it is free and right all the way."""
    def f16(n: int) -> float:
        return 0.012 if n == 1 else 0.032 * (1 + 0.1 * (n - 1))

    measured = VerifyCost()
    measured.add(3, f16(3))
    ks = simulate(0.9, all_or_nothing=True, cost=f16, measured=measured, mute=3)
    assert 2 in ks[:6] and np.mean(ks[-50:]) >= 16, ks

def test_a_decode_of_one_token_is_kept_apart_from_the_line():
    c = VerifyCost()
    assert not c.known() and c.one() is None
    c.add(1, 0.010)
    assert c.known() and c.at(1) == pytest.approx(0.010) and c.fit()[0] == 0.010
    for n in [2, 5, 9] * 5:
        c.add(n, 0.016 * (1 + 0.1 * (n - 1)))
    a, slope = c.fit()
    assert a == pytest.approx(0.016, rel=0.05) and slope == pytest.approx(0.1, rel=0.1)
    assert c.at(1) == pytest.approx(0.010) and c.at(9) == pytest.approx(0.0288, rel=0.05)
    for t in (0.019, 0.010, 0.011):  # one busy moment: the median of the last 5
        c.add(1, t)
    assert c.one() == 0.010 and c.n_one() == 4
    d = VerifyCost()
    d.add(1, 0.05)
    d.add(4, 0.01)  # (noise) a longer decode is never priced under one token's
    assert d.at(4) == pytest.approx(0.05)


def test_k_respects_draft_min_so_learning_never_stops():
    """A draft shorter than --draft-min is discarded before observe: a length under it is
    never chosen (it would teach nothing); a draft that does not pay is not drafted, but
    now and then one of --draft-min tokens is, so that the estimates stay alive."""
    src = Echo()
    ad = Adaptive(src, VerifyCost(), n_min=5, prior=0.05)
    rng = np.random.default_rng(0)
    for _ in range(200):
        ad.propose([1], 64, SP, rng)
        ad.accept(accepted(0))
    assert src.asked and min(src.asked) >= 5 and len(src.asked) < 100


def explored(p: float) -> int:
    """Steps drafted after the first ten by a cheap draft right 30% of the time (it loses:
    k = 0 is the plan) on the F16 SmolLM2's costs, missing the plain steps and catching up
    on them at p seconds a token."""
    def f16(n: int) -> float:
        return 0.011 if n == 1 else 0.028 * (1 + 0.1 * (n - 1))

    ks = simulate(0.3, steps=300, c=0.002, cost=f16, catch_up=p)
    return sum(k > 0 for k in ks[10:])


def test_exploring_costs_a_share_of_the_rest_it_follows():
    """Where no draft pays, a step drafts again once the plain steps since the last draft
    have earned its cost (4% of their time): a draft with nothing to catch up explores every
    50 steps or so; a draft model whose catch-up grows with its rest (0.8 ms a token, 0.4
    of a drafted one, as measured) once, to learn what a catch-up costs (drawn at random, 4%
    of the steps, catch-ups of up to 91 tokens took 280 ms each on the F16 SmolLM2: a
    quarter of `run --draft auto`'s speed)."""
    assert 3 <= explored(0.0) <= 10
    assert explored(0.0008) <= 1


def test_a_draft_that_does_not_pay_is_not_drafted():
    """0 is a length: a draft as slow as its target (a batch of two costs 1.3 of one), even
    one always right, decodes the target alone but for the exploring steps; a cheap draft
    right 70% of the time drafts (right half the time, its best length beats the target
    alone by 7% only, within the noise of an acceptance measured over about 20 steps: the
    line through the verifications once priced a plain step dearer than it is, so that it
    drafted)."""
    costly = simulate(1.0, c=0.01)
    assert sum(k == 0 for k in costly[-100:]) >= 85, costly[-100:]
    cheap = simulate(0.7, c=0.001)
    assert sum(k == 0 for k in cheap[-100:]) <= 10 and np.mean(cheap[-100:]) >= 1


def test_a_batch_of_one_plans_the_cost_models_best_length():
    """Alone, the plan is the k of cost.CostModel's best speedup (0 where none is above 1)."""
    for acc, c in [(0.8, 0.003), (0.95, 0.001), (0.5, 0.01), (0.3, 0.02)]:
        s = acc ** np.arange(1, 17)
        gains = CostModel.line(c, 0.02, 0.15, 16).speedups(s)
        want = 1 + int(np.argmax(gains)) if gains.max() > 1 else 0
        assert plan_batch(s[None, :], 0.02, 0.15, c)[0] == want, (acc, c)


def test_a_batch_drafts_one_length_longer_where_its_drafts_are_right_more_often():
    """One length for every slot (unequal lengths cost llama.cpp several graph runs), a
    slot's cap where lower; longer where the drafts are right more often."""
    good, poor = 0.9 ** np.arange(1, 17), 0.5 ** np.arange(1, 17)
    kg = plan_batch(np.stack([good, good]), 0.02, 0.1, 0.001)
    kp = plan_batch(np.stack([poor, poor]), 0.02, 0.1, 0.001)
    assert kg[0] == kg[1] > kp[0] == kp[1] >= 0
    mixed = plan_batch(np.stack([good, poor]), 0.02, 0.1, 0.001)
    assert mixed[0] == mixed[1] > 0
    capped = plan_batch(np.stack([good, np.concatenate([good[:2], np.zeros(14)])]), 0.02,
                        0.1, 0.001)
    assert capped[0] > capped[1] == 2


def simulate_batch(others: int, steps: int = 300, slope: float = 0.15,
                   acceptance: float = 0.8, c: float = 0.001) -> list[int]:
    """One slot of a server's batch of 1 + `others` slots with the same draft (the others'
    curves as measured: geometric); a fake clock on which the decode of n tokens costs
    0.01 * (1 + slope (n - 1)), timed where it is made, as batching.SharedContext does."""
    rng = np.random.default_rng(1)
    now, batch = [0.0], Batch()
    for i in range(others):
        batch.choose(("other", i), acceptance ** np.arange(1, 65), c)
    ad = Adaptive(Slow(now, c), seed=0, clock=lambda: now[0], batch=batch, who="me")
    ks = []
    for _ in range(steps):
        p = ad.propose([1, 2, 3], 64, SP, rng)
        n_acc = 0
        while n_acc < len(p.tokens) and rng.random() < acceptance:
            n_acc += 1
        n = (others + 1) * (len(p.tokens) + 1)  # the others draft the plan's length too
        batch.cost.add(n, 0.01 * (1 + slope * (n - 1)))
        ad.accept(accepted(n_acc))
        ks.append(ad.k)
    return ks


def test_a_slot_drafts_alone_and_decodes_plainly_in_a_full_batch():
    """The same draft, right 80% of the time at a tenth of the target's cost: alone it pays
    (k of 2 or more); in a batch of 16 (compute-bound: a token adds 0.3 of a decode of one)
    a drafted token costs nearly what a plain one does,
    and the batch's goodput is highest at k = 0 (plain batched decoding), with no threshold
    on the batch size anywhere."""
    alone = simulate_batch(0, slope=0.3)
    assert np.mean(alone[-100:]) >= 2, alone[-100:]
    full = simulate_batch(15, slope=0.3)
    assert sum(k == 0 for k in full[-100:]) >= 85, full[-100:]


def test_the_plan_is_for_the_batch_not_for_one_slot_beside_the_others():
    """Four slots each drafting 8: to any one of them its own draft looks free (the others
    pay the drafting time), yet all four decoding plainly is worth more where verification
    is compute-bound: the batch plans k = 0 for every slot."""
    S = np.tile(0.7 ** np.arange(1, 9), (4, 1))
    assert list(plan_batch(S, 0.02, 0.6, 0.004)) == [0, 0, 0, 0]
    assert min(plan_batch(S, 0.02, 0.05, 0.004)) >= 2  # memory-bound: all draft


def test_a_batch_forgets_a_slot_at_its_generations_end():
    batch = Batch()
    ad = Adaptive(Echo(), batch=batch, who="me")
    ad.begin([1])
    ad.propose([1], 4, SP, np.random.default_rng(0))
    assert batch.members() == 1
    ad.end()
    assert batch.members() == 0


def test_the_batch_plan_is_made_once_an_iteration(monkeypatch):
    """The slots of a batch take their k from one plan made when the first of them asks
    (each slot then steps with the others' curves as of their last step), and a new one
    when a slot asks again: once an iteration, not once a slot."""
    import specli.drafts.adaptive as adaptive

    made = []
    real = adaptive.plan_batch

    def counted(S, *a):
        made.append(S.shape[0])
        return real(S, *a)

    monkeypatch.setattr(adaptive, "plan_batch", counted)
    batch = Batch()
    for _ in range(20):
        batch.cost.add(1, 0.010)
        batch.cost.add(9, 0.020)
    slots = [object() for _ in range(4)]
    good = np.full(8, 0.9) ** np.arange(1, 9)
    for s in slots:  # each joins: the plan so far does not know it
        batch.choose(s, good, 0.001)
    assert made == [1, 2, 3, 4]
    made.clear()
    for _ in range(3):  # three iterations of the four slots
        ks = [batch.choose(s, good, 0.001) for s in slots]
        assert ks == [ks[0]] * 4 and ks[0] > 0
    assert made == [4, 4, 4]
    batch.drop(slots[1])
    made.clear()
    assert batch.choose(slots[0], good, 0.001) > 0 and made == [3]


def test_a_slot_beside_others_does_not_explore_a_draft_that_cannot_pay():
    """A draft that would not pay even if always right explores at a generation's first
    step only alone (to `run`, that step costs its own time); beside other slots it would
    cost every one of them a catch-up of the whole prompt and a decode of unequal lengths
    (served, 8 clients: 2-4 drafted steps a request, each catching up 40-80 tokens)."""
    def first_k(others: int) -> int:
        now, batch = [0.0], Batch()
        b = others + 1
        for _ in range(20):  # a plain step of b slots: 7.3 ms a slot
            batch.cost.add(b, 0.0073 * b)
        for i in range(others):
            batch.choose(("other", i), 0.9 ** np.arange(1, 9), 0.0073 * b)
        ad = Adaptive(Slow(now, 0.0073 * b), seed=0, clock=lambda: now[0], batch=batch,
                      who="me")  # its draft as slow as the target's plain step
        ad.propose([1], 8, SP, np.random.default_rng(0))  # its cost measured
        ad.accept(accepted(1))
        ad.begin([1])  # the next generation
        ad.propose([1], 8, SP, np.random.default_rng(0))
        return ad.k

    assert first_k(0) == 1
    assert first_k(7) == 0


class Behind(Slow):
    """Slow, whose draft is `n` tokens short of the context until it drafts (a server
    slot's lazy draft after plain steps); its catch-up costs p seconds a token."""

    def __init__(self, now: list[float], c: float, n: int, p: float):
        super().__init__(now, c)
        self.n, self.p = n, p

    def behind(self, context):
        return self.n

    def catch_up(self, context):
        self.now[0] += self.p * self.n
        self.n = 0
        return True


def test_a_draft_far_behind_does_not_switch_to_drafting_for_a_step():
    """The same batch that drafts when its drafts are caught up stays plain when every
    slot's draft would first decode hundreds of missed tokens (8 clients after plain steps:
    one such switch cost 1.5-2.5 s); a catch-up that pays for itself within the horizon
    (a short prompt not yet fed) is made."""
    S = np.tile(0.9 ** np.arange(1, 9), (4, 1))
    args = (0.02, 0.1, 0.001)
    assert min(plan_batch(S, *args)) >= 2
    assert min(plan_batch(S, *args, np.full(4, 300.0), 0.002)) == 0
    assert min(plan_batch(S, *args, np.full(4, 20.0), 0.002)) >= 2


def test_catch_ups_of_one_iteration_are_one_decode():
    """Each slot's clock saw the one combined decode: an iteration's catch-ups count once,
    with all their tokens, when the next plan is made; before any, a drafted token's cost
    at the prior slope."""
    batch = Batch()
    assert batch.catch_up.rate(0.01) == pytest.approx(0.01 * 0.15)
    for _ in range(4):
        batch.catch_up.add(100, 0.4)  # four slots, 100 tokens each, one 0.4 s decode
    batch.choose("me", 0.9 ** np.arange(1, 9), 0.001)
    assert batch.catch_up.rate(0.01) == pytest.approx(0.4 / 400)


def test_the_catch_up_is_timed_and_counted_in_the_plan():
    """Alone, with a draft 1,000 tokens behind that costs 2 ms a token to catch up (2 s),
    the plan decodes plainly (it learnt the rate); 10 tokens behind, it drafts."""
    def ks(n_behind: int) -> list[int]:
        now, batch = [0.0], Batch()
        for _ in range(20):
            batch.cost.add(1, 0.01)
            batch.cost.add(9, 0.02)
        batch.catch_up.add(100, 0.2)  # measured before: 2 ms a token
        ad = Adaptive(Behind(now, 0.001, n_behind, 0.002), seed=0, clock=lambda: now[0],
                      batch=batch, who="me")
        ad._first = False  # (not a generation's first step, which explores)
        out = []
        for _ in range(5):
            p = ad.propose([1, 2, 3], 8, SP, np.random.default_rng(0))
            ad.accept(accepted(len(p.tokens)))
            out.append(ad.k)
        return out

    assert ks(1000) == [0] * 5
    assert min(ks(10)) >= 1


def test_a_slot_beside_others_never_explores_a_draft_the_plan_skips():
    """Beside other slots, k = 0 means no draft at all: one slot's exploring draft would
    make a decode of unequal lengths for everyone (8 clients: 8% of the throughput);
    alone, a share of the steps still drafts so that the estimates stay alive."""
    def drafted(others: int) -> int:
        now, batch = [0.0], Batch()
        b = others + 1
        for _ in range(20):  # compute-bound: a token adds 0.9 of a decode of one
            batch.cost.add(b, 0.01 * (1 + 0.9 * (b - 1)))
            batch.cost.add(2 * b, 0.01 * (1 + 0.9 * (2 * b - 1)))
        for i in range(others):
            batch.choose(("other", i), 0.5 ** np.arange(1, 9), 0.005)
        ad = Adaptive(Slow(now, 0.005), seed=3, clock=lambda: now[0], batch=batch,
                      who="me", prior=0.5)
        n = 0
        for _ in range(400):
            p = ad.propose([1], 8, SP, np.random.default_rng(0))
            ad.accept(accepted(0))
            n += bool(p.tokens)
        return n

    assert drafted(0) > 0
    assert drafted(7) == 0


def test_a_slot_left_alone_prices_its_draft_at_one_slot_not_at_the_batch_it_drafted_in():
    """A server slot last drafted beside seven others, whose one combined position took
    60 ms (8 slots' tokens cost the Q4_1 draft about what they cost the target): alone, its
    shared draft model costs what the draft context's line says for one slot (5 ms), so it
    drafts; priced at what its own clock saw last, it would never draft again."""
    batch = Batch()
    for _ in range(20):
        batch.cost.add(1, 0.02)
        batch.cost.add(9, 0.035)
        batch.draft.add(1, 0.005)
        batch.draft.add(8, 0.060)
    good = 0.9 ** np.arange(1, 9)
    assert batch.choose("me", good, 0.060, shared=True) >= 2
    assert batch.choose("me", good, 0.060, shared=False) == 0


def test_a_noisy_fit_never_says_a_longer_decode_costs_less():
    """Points that say more tokens cost less (a slow small decode beside fast large ones)
    give slope 0 and the mean time, not a line whose a is far above every point (it once
    read 143 ms for decodes of 60, so that verifying more tokens looked free)."""
    c = VerifyCost()
    for _ in range(10):
        c.add(2, 0.140)
        c.add(40, 0.060)
    a, slope = c.fit()
    assert slope == 0.0 and 0.06 <= a <= 0.14


def test_a_plan_alone_of_no_draft_is_not_made_again_until_something_it_knew_changed():
    """A plain step on the F16 SmolLM2 takes 10 ms and a plan 250-370 us: while nothing the
    plan knew has changed but the draft's catch-up (which only grows), its 0 stands; a dearer
    decode of one token, or a verified proposal, makes it again."""
    c = VerifyCost()
    for n in (2, 5, 9) * 3:
        c.add(n, 0.03 * (1 + 0.1 * (n - 1)))
    for _ in range(3):
        c.add(1, 0.010)
    ad = Adaptive(Echo(), c, prior=0.3)
    ad.begin([1])
    ad._t_draft, ad._n_draft, ad._first = 0.008, 1.0, False
    made, choose = [], ad.batch.choose
    ad.batch.choose = lambda *a, **kw: (made.append(1), choose(*a, **kw))[1]
    ks = [ad.best_k(64) for _ in range(5)]
    assert ks == [0] * 5 and len(made) == 1
    c.add(1, 0.009)  # cheaper: still 0, not planned again
    assert ad.best_k(64) == 0 and len(made) == 1
    for _ in range(3):
        c.add(1, 0.5)  # dearer: planned again, and now drafting pays
    assert ad.best_k(64) > 0 and len(made) == 2


def test_a_batch_whose_target_is_not_yet_timed_does_not_draft_blind():
    """Before any decode of the target is timed the plan priced one at 1 s, so that a draft
    of 7 ms a token was free: a server's first requests drafted up to 64 tokens a step
    (0.8 s for two slots' first). Now it is priced at the draft's time a token until timed."""
    batch = Batch()
    good = 0.95 ** np.arange(1, 65)
    assert batch.choose("a", good, 0.007) == 0 and batch.choose("b", good, 0.007) == 0
    for _ in range(3):
        batch.cost.add(2, 0.030)  # two slots' plain step, timed: a decode costs 15x a token
    batch.choose("a", good, 0.001)
    assert batch.choose("b", good, 0.001) > 0
