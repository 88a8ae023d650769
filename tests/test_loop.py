"""The loop's edge cases on a fake model (tests/fakes.py): milliseconds each, and exact, as a
fake decode does not depend on the batch. Fidelity against llama.cpp itself stays in
test_engine.py and test_parity.py."""

from __future__ import annotations

import pytest
from fakes import EOG, FakeModel

from specli.backend import Backend
from specli.config import DraftPolicy, NgramParams, SamplingParams, SpecRequest
from specli.drafts import ModelDraft
from specli.engine import Engine
from specli.errors import BackendError, ContextOverflowError
from specli.plan import combine, ngram_drafts
from specli.stats import Stats

GREEDY = SamplingParams(temp=0.0)
PROMPTS = ["the quick brown fox", "hello, world", "abcabcabcabc", "speculative decoding"]


def engine(k: int = 4, noise: float = 1.5, seed: int = 3, types=(), adaptive=False,
           draft: bool = True, spread: float = 2.0, **policy) -> Engine:
    target = FakeModel(seed=seed, spread=spread)
    sources = ngram_drafts(types, NgramParams(size_n=2, size_m=6, mod_n_match=2,
                                              mod_n_max=8, mod_n_min=1))
    if draft:
        sources.append(ModelDraft(FakeModel(seed=seed, noise=noise, spread=spread)))
    p = DraftPolicy(n_max=k, adaptive=adaptive, **policy)
    return Engine(target, combine(sources, adaptive, p.n_min), p)


def consistent(e: Engine, context: list[int]) -> None:
    """The target holds every committed token but the last; the draft a prefix of them."""
    assert e.target.tokens == context[:-1]
    if e.draft_model is not None:
        d = e.draft_model.tokens
        assert d == context[: len(d)]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_is_the_targets(k, prompt):
    e = engine(k)
    ids = e.tokenize(prompt)
    out = e.complete(ids, 60, GREEDY)
    assert out.tokens == e.target.greedy(ids, 60)
    assert out.tokens == e.complete(ids, 60, GREEDY, speculative=False).tokens
    assert out.stats.n_drafted > 0


def test_every_step_rewinds_both_caches_to_the_committed_tokens():
    e = engine(6)
    ids = e.tokenize(PROMPTS[0])
    stats, context, checked = Stats(), list(ids), 0
    for token, from_draft in e.steps(ids, 120, GREEDY, stats):
        context.append(token)
        if not from_draft:  # the step's own token: the step is over, its caches rewound
            consistent(e, context)
            checked += 1
    assert checked == stats.n_predict - stats.n_accept  # one target token per step
    partial = sum(1 for d, a in zip(stats.drafted_per_pos, stats.accepted_per_pos, strict=True)
                  if a < d)
    assert partial > 0, "the noisy draft should be rejected somewhere"
    assert 0 < stats.n_accept < stats.n_drafted


def test_at_every_yield_the_caches_hold_only_tokens_that_will_be_committed():
    """Rejected drafts never linger: at each yield (mid-step too) both caches hold a prefix
    of the final answer."""
    e = engine(5)
    ids = e.tokenize(PROMPTS[1])
    snapshots, context = [], list(ids)
    for token, _ in e.steps(ids, 80, GREEDY, Stats()):
        context.append(token)
        snapshots.append((list(e.target.tokens), list(e.draft_model.tokens)))
    for target, draft in snapshots:
        assert target == context[: len(target)] and draft == context[: len(draft)]
    assert any(len(t) > len(d) for t, d in snapshots), "the draft lags after a rejection"


def test_an_accepted_end_of_generation_token_ends_the_step():
    """Self-speculation (draft == target) accepts every token, so the end-of-generation token
    arrives inside an accepted draft; it is not emitted, and the answer equals plain's."""
    target = FakeModel(seed=11, eog_bias=3.0)
    e = Engine(target, ModelDraft(FakeModel(seed=11, eog_bias=3.0)), DraftPolicy(n_max=8))
    for prompt in PROMPTS:
        ids = e.tokenize(prompt)
        out = e.complete(ids, 200, GREEDY)
        plain = target.greedy(ids, 200)
        assert out.tokens == plain and EOG not in out.tokens
        assert out.stats.finish_reason == ("stop" if len(plain) < 200 else "length")
    assert any(e.complete(e.tokenize(p), 200, GREEDY).stats.finish_reason == "stop"
               for p in PROMPTS)


@pytest.mark.parametrize("n", [1, 2, 5, 17])
def test_the_budget_is_exact(n):
    e = engine(8, noise=0.0)  # full acceptance: the budget, not the draft, ends each step
    out = e.complete(e.tokenize(PROMPTS[0]), n, GREEDY)
    assert len(out.tokens) == n and out.stats.n_predict == n
    assert out.stats.finish_reason == "length"


def test_a_full_context_stops_and_a_too_long_prompt_is_refused():
    target, draft = FakeModel(seed=3, n_ctx=40, eog_bias=-50), FakeModel(seed=3, n_ctx=40)
    e = Engine(target, ModelDraft(draft), DraftPolicy(n_max=8))
    ids = e.tokenize("0123456789")
    out = e.complete(ids, -1, GREEDY)
    assert len(ids) + len(out.tokens) == 40 + 1  # the last token never enters the cache
    assert out.stats.finish_reason == "length"
    with pytest.raises(ContextOverflowError):
        e.complete(e.tokenize("x" * 40), 4, GREEDY)


@pytest.mark.parametrize("who, call", [("target", 4), ("draft", 5)])
def test_a_failed_decode_leaves_committed_caches_and_the_next_run_is_exact(who, call):
    e = engine(4)
    ids = e.tokenize(PROMPTS[3])
    reference = e.target.greedy(ids, 40)
    model = e.target if who == "target" else e.draft_model
    model.fail_on_call = model.n_decode_calls + call
    emitted = list(ids)
    with pytest.raises(BackendError, match="fake"):
        for token, _ in e.steps(ids, 40, GREEDY, Stats()):
            emitted.append(token)
    consistent(e, emitted)
    model.fail_on_call = None
    assert e.complete(ids, 40, GREEDY).tokens == reference


def test_a_chain_drafts_from_ngrams_first_and_the_model_fills_in():
    e = engine(6, types=("ngram-simple", "ngram-mod"))
    ids = e.tokenize(PROMPTS[2] * 3)
    out = e.complete(ids, 100, GREEDY)
    assert out.tokens == e.target.greedy(ids, 100)
    assert "draft" in out.stats.per_source
    assert set(out.stats.per_source) - {"draft"}, "an n-gram type drafted too"


def test_adaptive_k_keeps_the_output_and_stays_within_its_cap():
    e = engine(64, adaptive=True, noise=0.3)
    ids = e.tokenize(PROMPTS[0])
    out = e.complete(ids, 150, GREEDY)
    assert out.tokens == e.target.greedy(ids, 150)
    # (how long it drafts depends on real timings here: test_adaptive.py runs a fake clock)
    assert len(out.stats.drafted_per_pos) <= 64


def test_the_engine_times_every_step_for_draft_auto_plain_ones_too():
    """`run --draft auto` prices a plain step as timed (a decode of one token is not the
    verifications' line read at n = 1): the engine times each step into the draft's cost,
    but a generation's first (cold: a draft of 2 tokens, its cost unknown)."""
    e = engine(64, adaptive=True, noise=0.3)
    timed, add = [], e.draft.cost.add
    e.draft.cost.add = lambda n, s: (timed.append(n), add(n, s))
    out = e.complete(e.tokenize(PROMPTS[0]), 100, GREEDY)
    assert len(timed) == out.stats.n_steps + out.stats.n_plain - 1
    assert timed.count(1) == out.stats.n_plain > 0 and e.draft.cost.one() is not None
    assert sum(timed) - len(timed) == out.stats.n_drafted - 2


def test_a_requests_policy_overlays_the_engines():
    e = engine(8, noise=0.0)
    ids = e.tokenize(PROMPTS[0])
    limited = e.complete(ids, 60, GREEDY, spec=SpecRequest(n_max=3))
    assert len(limited.stats.drafted_per_pos) == 3 and limited.stats.n_draft == 3
    short = engine(8, noise=1.5).complete(ids, 60, GREEDY, spec=SpecRequest(n_min=5))
    drafted = short.stats.drafted_per_pos
    assert drafted[4] == drafted[0] == short.stats.n_steps, "every verified draft is >= 5"
    # the engine's own policy is untouched by a request's
    assert e.complete(ids, 60, GREEDY).stats.n_draft == 8


def test_p_min_stops_a_draft_early_and_keeps_the_output():
    ids = FakeModel().tokenize(PROMPTS[3])
    sharp = {"spread": 8.0, "noise": 1.0}  # confident enough that p_min 0.9 drafts at all
    plain = engine(8, **sharp).complete(ids, 80, GREEDY)
    confident = engine(8, p_min=0.9, **sharp).complete(ids, 80, GREEDY)
    assert confident.tokens == plain.tokens
    assert confident.stats.n_drafted > 0
    per_step = [s.n_drafted / s.n_steps for s in (plain.stats, confident.stats)]
    assert per_step[1] < per_step[0]


def test_sampling_is_reproducible_per_seed():
    e = engine(4)
    ids = e.tokenize(PROMPTS[0])
    a = e.complete(ids, 50, SamplingParams(temp=0.9, seed=7)).tokens
    b = e.complete(ids, 50, SamplingParams(temp=0.9, seed=7)).tokens
    c = e.complete(ids, 50, SamplingParams(temp=0.9, seed=8)).tokens
    assert a == b and a != c


def test_draft_p_min_stops_drafting_and_draft_min_drops_short_drafts():
    ids = FakeModel().tokenize(PROMPTS[3] * 2)
    k, sharp = 4, {"spread": 8.0, "noise": 1.0}  # a confident model, as LLMs are
    outs = {name: engine(k, **sharp, **policy).complete(ids, 96, GREEDY) for name, policy in {
        "plain": {}, "p_min": {"p_min": 0.9}, "n_min": {"n_min": k, "p_min": 0.9}}.items()}
    plain, p_min, n_min = outs["plain"].stats, outs["p_min"].stats, outs["n_min"].stats
    assert outs["p_min"].tokens == outs["plain"].tokens == outs["n_min"].tokens
    # a confident-only draft proposes fewer tokens per step and is accepted more often
    assert p_min.n_drafted / p_min.n_steps < plain.n_drafted / plain.n_steps
    assert p_min.accept_rate >= plain.accept_rate
    # with --draft-min = k, every verified draft is exactly k long
    assert n_min.n_steps > 0
    assert n_min.n_drafted == k * n_min.n_steps and n_min.n_steps < p_min.n_steps


def test_prompt_longer_than_context_is_an_error_and_a_full_context_stops():
    e = Engine(FakeModel(seed=3, n_ctx=64), ModelDraft(FakeModel(seed=3, noise=1.5, n_ctx=64)),
               DraftPolicy(n_max=8))
    with pytest.raises(ContextOverflowError):
        e.complete(e.tokenize("word " * 20), 10, GREEDY)
    ids = e.tokenize(PROMPTS[0])
    out = e.complete(ids, -1, GREEDY)
    assert out.stats.finish_reason in ("length", "stop")
    assert len(ids) + len(out.tokens) <= 64 + 1


def test_the_fake_is_a_backend():
    """The fake implements the interface the engine uses of a model (backend.Backend), as
    the real Model and a server slot's sequence do (test_shared_context.py), role by role."""
    from specli.backend import Branches, Decoder, States, Vocabulary

    for role in (Backend, Vocabulary, Decoder, Branches, States):
        assert isinstance(FakeModel(), role), role


def test_the_rules_follow_the_path_the_rows_are_asked_along():
    """_rows moves the rules (DRY, a grammar) past each accepted node as verification
    descends, once; a row asked for again is the same row; one asked for off that path is
    an error, never a row masked for the wrong history."""
    import numpy as np

    from specli.drafts.tree import Tree
    from specli.engine import _rows

    class Seen:
        def __init__(self):
            self.tokens: list[int] = []

        def accept(self, token: int) -> None:
            self.tokens.append(token)

        def apply(self, row, need):
            return row

    rules, rows = Seen(), np.zeros((4, 8), np.float32)
    row = _rows(rows, SamplingParams(temp=0.0), [1, 2], Tree.chain([5, 6, 7]), rules)
    first = row(0, [])
    row(1, [0])
    row(2, [0, 1])
    assert rules.tokens == [5, 6] and row(0, []) is first
    with pytest.raises(RuntimeError, match="off the path"):
        row(3, [1])
