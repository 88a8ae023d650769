"""Logit bias and the repetition penalties (issue 18, part 3): the same transform on target and
draft rows keeps speculation exact. The transform is checked against llama.cpp's own
samplers (the oracle), greedy speculative output against plain decoding with the transform,
and sampling against the transformed target's exact distribution by chi-square."""

from __future__ import annotations

import ctypes
from collections import Counter

import llama_cpp
import numpy as np
import pytest
from fakes import FakeModel
from test_sampling import N_SEEDS, chi_square, exact_sequences

from specli import engine as engine_mod
from specli.config import DraftParams, ModelParams, SamplingParams
from specli.drafts import ModelDraft, NgramSimple
from specli.engine import Engine
from specli.plan import load
from specli.verify import transform

BIAS = ((3, 4.0), (7, -2.5), (3, 1.0), (11, float("-inf")))
PENALTIES = {"repeat_penalty": 1.3, "repeat_last_n": 8, "frequency_penalty": 0.4,
             "presence_penalty": 0.6}


def llama_transform(row: np.ndarray, bias, history, last_n, repeat, freq, present):
    """What llama.cpp's logit-bias then penalties samplers do to the row."""
    n = row.shape[0]
    data = (llama_cpp.llama_token_data * n)(*[llama_cpp.llama_token_data(i, float(v), 0.0)
                                               for i, v in enumerate(row)])
    arr = llama_cpp.llama_token_data_array(data, n, -1, False)
    lb = (llama_cpp.llama_logit_bias * max(len(bias), 1))(
        *[llama_cpp.llama_logit_bias(t, b) for t, b in bias])
    samplers = [llama_cpp.llama_sampler_init_logit_bias(n, len(bias), lb),
                llama_cpp.llama_sampler_init_penalties(n, last_n, repeat, freq, present)]
    try:
        for t in history:
            llama_cpp.llama_sampler_accept(samplers[1], t)
        for s in samplers:
            llama_cpp.llama_sampler_apply(s, ctypes.byref(arr))
        out = np.empty(n, dtype=np.float32)
        for i in range(arr.size):
            out[arr.data[i].id] = arr.data[i].logit
        return out
    finally:
        for s in samplers:
            llama_cpp.llama_sampler_free(s)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("last_n", [4, 64, -1])
def test_the_transform_is_llama_cpps(seed, last_n):
    rng = np.random.default_rng(seed)
    row = rng.normal(0, 3, 50).astype(np.float32)
    before = row.copy()
    history = rng.integers(0, 50, 40).tolist()
    sp = SamplingParams(logit_bias=BIAS, repeat_penalty=1.3, repeat_last_n=last_n,
                        frequency_penalty=0.4, presence_penalty=0.6)
    ours = transform(row, sp, history)
    theirs = llama_transform(row, BIAS, history, len(history) if last_n < 0 else last_n,
                             1.3, 0.4, 0.6)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-5)
    assert np.array_equal(row, before), "the model's own row is left as it was"


def test_nothing_to_apply_is_the_row_itself():
    row = np.arange(5, dtype=np.float32)
    assert transform(row, SamplingParams(), [1, 2, 3]) is row
    assert transform(row, SamplingParams(repeat_penalty=1.5, repeat_last_n=0), [1]) is row


def engines(draft: str):
    target = FakeModel(seed=5)
    if draft == "model":
        return Engine(target, ModelDraft(FakeModel(seed=5, noise=1.0)), DraftParams(n_max=4))
    return Engine(target, NgramSimple(size_n=2, size_m=4), DraftParams(n_max=4))


@pytest.mark.parametrize("draft", ["model", "ngram"])
@pytest.mark.parametrize("extra", [{"logit_bias": BIAS}, PENALTIES,
                                   {"logit_bias": BIAS, **PENALTIES}])
def test_greedy_speculation_equals_plain_decoding_under_the_transform(draft, extra):
    sp = SamplingParams(temp=0.0, **extra)
    e = engines(draft)
    prompt = e.tokenize("abcabcabc hello hello hello")
    plain = e.complete(prompt, 80, sp, speculative=False)
    fast = e.complete(prompt, 80, sp)
    assert fast.tokens == plain.tokens
    assert fast.stats.n_drafted > 0
    untouched = e.complete(prompt, 80, SamplingParams(temp=0.0), speculative=False)
    assert untouched.tokens != plain.tokens, "the transform must change the output"
    if "logit_bias" in extra:
        assert 11 not in plain.tokens and 3 in plain.tokens


def test_greedy_speculation_equals_plain_on_a_real_f16_target(f16, q4_1):
    e = load(ModelParams(f16, n_ctx=512), ModelParams(q4_1, n_ctx=512),
                    DraftParams(n_max=6))
    try:
        prompt = e.tokenize("List the days of the week, one per line:", chat=True)
        base = e.complete(prompt, 48, SamplingParams(temp=0.0), speculative=False)
        banned = base.tokens[3]
        sp = SamplingParams(temp=0.0, logit_bias=((banned, float("-inf")),),
                            repeat_penalty=1.2, repeat_last_n=32, presence_penalty=0.3)
        plain = e.complete(prompt, 48, sp, speculative=False)
        fast = e.complete(prompt, 48, sp)
        assert fast.tokens == plain.tokens != base.tokens
        assert banned not in plain.tokens
        assert fast.stats.n_accept > 0
    finally:
        e.close()


# milder than BIAS: with +5 on token 3 the target would reject every n-gram proposal
SP = SamplingParams(temp=0.8, top_k=40, top_p=0.95, min_p=0.05,
                    logit_bias=((3, 1.5), (7, -2.5), (11, float("-inf"))), **PENALTIES)


def exact(e: Engine, prompt: list[int], depth: int, sp: SamplingParams) -> dict:
    """The transformed target's distribution over the next `depth` tokens."""
    return exact_sequences(e, prompt, depth, sp, lambda row, ctx, _: transform(row, sp, ctx))


def runs(e: Engine, prompt: list[int], n: int, sp: SamplingParams) -> tuple[Counter, float]:
    seen, drafted, accepted = Counter(), 0, 0
    for seed in range(N_SEEDS):
        out = e.complete(prompt, n, SamplingParams(**{**sp.__dict__, "seed": seed}))
        seen[tuple(out.tokens)] += 1
        drafted, accepted = drafted + out.stats.n_drafted, accepted + out.stats.n_accept
    return seen, accepted / max(drafted, 1)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_sampling_follows_the_transformed_target(draft):
    e = engines(draft)
    target = e.target
    if draft == "ngram":  # text that repeats the target's own path, so the n-gram proposes
        path = target.greedy(target.tokenize("My favourite fruits are"), 12)
        prompt = [*path, *target.tokenize(" and "), *path[:6]]
    else:
        prompt = e.tokenize("The three primary colours are red,")
    expected = exact(e, prompt, 3, SP)
    seen, rate = runs(e, prompt, 3, SP)
    assert 0.05 < rate < 0.99, "the draft must be rejected sometimes for this to test anything"
    assert chi_square(seen, expected, N_SEEDS) > 0.01


@pytest.mark.slow
def test_the_check_catches_an_untransformed_target(monkeypatch):
    """Verifying against the raw rows samples the untransformed distribution: the same
    chi-square check fails."""
    e = engines("model")
    prompt = e.tokenize("The three primary colours are red,")
    expected = exact(e, prompt, 3, SP)
    monkeypatch.setattr(engine_mod, "_rows", lambda rows, sp, context, tree, rules=None:
                        lambda r, path: rows[r])
    seen, _ = runs(e, prompt, 3, SP)
    assert set(seen) - set(expected) or chi_square(seen, expected, N_SEEDS) < 0.01


# -- DRY: llama.cpp's own sampler, stateful, forked for drafts and verification --------------

DRY = {"dry_multiplier": 1.5, "dry_base": 1.75, "dry_allowed_length": 2,
       "dry_penalty_last_n": -1}


def test_dry_penalizes_the_token_that_extends_a_repetition(f16):
    from specli.backend import Model

    m = Model(ModelParams(f16, n_ctx=256))
    try:
        ids = m.tokenize("one two three four five one two three four", add_special=False)
        dry = m.dry(SamplingParams(**DRY))
        for t in ids:
            dry.accept(t)
        row = np.zeros(m.n_vocab, dtype=np.float32)
        out = dry.apply(row)
        nxt = ids[ids.index(ids[-1]) + 1]  # what followed "four" the first time
        assert out[nxt] < -1.0 and np.count_nonzero(out) == 1
        fork = dry.fork()
        fork.accept(nxt)
        assert np.count_nonzero(dry.apply(row)) == 1, "the fork leaves the state alone"
        fork.close()
        dry.close()
    finally:
        m.close()


@pytest.mark.parametrize("types", [(), ("ngram-simple",)])
def test_dry_keeps_greedy_speculation_exact(f16, q4_1, types):
    e = load(ModelParams(f16, n_ctx=512), ModelParams(q4_1, n_ctx=512),
                    DraftParams(n_max=6), spec_types=types)
    try:
        prompt = e.tokenize("Repeat after me ten times: I like green apples.", chat=True)
        base = e.complete(prompt, 48, SamplingParams(temp=0.0), speculative=False)
        sp = SamplingParams(temp=0.0, **DRY)
        plain = e.complete(prompt, 48, sp, speculative=False)
        fast = e.complete(prompt, 48, sp)
        assert fast.tokens == plain.tokens != base.tokens
        assert fast.stats.n_accept > 0
    finally:
        e.close()
