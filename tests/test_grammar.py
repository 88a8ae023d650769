"""Grammars (issue 18, part 1): the grammar masks the target at every verified position and
the draft's rows the same way; proposals that break it are cut before verification. Greedy
speculative output equals plain output under a grammar, sampled output follows the masked
target by chi-square, and on the real SmolLM2 family a JSON schema yields JSON that fits it."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from fakes import FakeGrammar, FakeModel
from test_sampling import N_SEEDS, chi_square, exact_sequences

from specli.backend import Grammar, schema_grammar
from specli.config import DraftParams, ModelParams, SamplingParams
from specli.drafts import ModelDraft, NgramSimple
from specli.engine import Engine
from specli.errors import UsageError
from specli.plan import load
from specli.verify import grammar_mask, need_for


def fake_engine(draft: str) -> Engine:
    target = FakeModel(seed=5)
    if draft == "model":
        return Engine(target, ModelDraft(FakeModel(seed=5, noise=1.0)), DraftParams(n_max=4))
    return Engine(target, NgramSimple(size_n=2, size_m=4), DraftParams(n_max=4))


def fits(tokens: list[int], m: int = 3) -> bool:
    return all(a % m != b % m for a, b in zip(tokens, tokens[1:], strict=False))


def test_the_mask_keeps_the_best_allowed_tokens():
    row = np.array([5.0, 9.0, 1.0, 7.0, 3.0], dtype=np.float32)
    odd = lambda ids: ids % 2 == 1  # noqa: E731
    out = grammar_mask(row, odd, 1)
    assert np.isfinite(out).sum() == 1 and out[1] == 9.0
    out = grammar_mask(row, odd, 5)
    assert np.flatnonzero(np.isfinite(out)).tolist() == [1, 3]


def test_a_large_vocabulary_is_scanned_past_the_first_chunk():
    row = np.arange(1000, dtype=np.float32)  # the best tokens are the highest ids
    out = grammar_mask(row, lambda ids: ids < 100, 3)
    assert np.flatnonzero(np.isfinite(out)).tolist() == [97, 98, 99]


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_greedy_speculation_equals_plain_decoding_under_a_grammar(draft):
    sp = SamplingParams(temp=0.0, grammar="3")
    e = fake_engine(draft)
    prompt = e.tokenize("abcabcabc hello hello hello")
    plain = e.complete(prompt, 80, sp, speculative=False)
    fast = e.complete(prompt, 80, sp)
    assert fast.tokens == plain.tokens and fits(plain.tokens)
    assert fast.stats.n_drafted > 0
    free = e.complete(prompt, 80, SamplingParams(temp=0.0), speculative=False)
    assert not fits(free.tokens), "the grammar must change the output"


SP = SamplingParams(temp=0.8, top_k=8, top_p=0.95, min_p=0.05, grammar="3")


def exact(e: Engine, prompt: list[int], depth: int) -> dict:
    """The masked target's distribution over the next `depth` tokens."""
    def mask(row, ctx, prefix):
        g = FakeGrammar(3, prefix[-1] if prefix else -1)
        return grammar_mask(row, g.allowed, need_for(SP, row.shape[0]))

    return exact_sequences(e, prompt, depth, SP, mask)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_sampling_follows_the_masked_target(draft):
    e = fake_engine(draft)
    target = e.target
    if draft == "ngram":  # text that repeats the grammar's own path, so the n-gram proposes
        path = target.greedy(target.tokenize("My favourite fruits are"), 12)
        prompt = [*path, *target.tokenize(" and "), *path[:6]]
    else:
        prompt = e.tokenize("The three primary colours are red,")
    expected = exact(e, prompt, 3)
    seen, drafted, accepted = Counter(), 0, 0
    for seed in range(N_SEEDS):
        out = e.complete(prompt, 3, SamplingParams(**{**SP.__dict__, "seed": seed}))
        seen[tuple(out.tokens)] += 1
        drafted, accepted = drafted + out.stats.n_drafted, accepted + out.stats.n_accept
    assert drafted and 0.05 < accepted / drafted < 0.99
    assert chi_square(seen, expected, N_SEEDS) > 0.01


# -- the real grammar sampler ----------------------------------------------------------------

@pytest.fixture(scope="module")
def family(f16, q4_1):
    e = load(ModelParams(f16, n_ctx=512), ModelParams(q4_1, n_ctx=512),
                    DraftParams(n_max=6), spec_types=("ngram-simple",))
    yield e
    e.close()


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"]}


def test_a_json_schema_gives_fitting_json_and_speculation_keeps_it_exact(family):
    prompt = family.tokenize("Describe a person as JSON with name, age and city.", chat=True)
    sp = SamplingParams(temp=0.0, grammar=schema_grammar(SCHEMA))
    plain = family.complete(prompt, 80, sp, speculative=False)
    fast = family.complete(prompt, 80, sp)
    assert fast.tokens == plain.tokens
    assert fast.stats.n_drafted > 0
    doc = json.loads(plain.text)
    assert set(doc) == {"name", "age", "city"} and isinstance(doc["age"], int)
    assert plain.stats.finish_reason == "stop"


def test_a_gbnf_grammar_cuts_drafts_that_break_it(family):
    """A prompt the n-gram drafts from, and a grammar its text does not fit: proposals are
    cut before verification, the output fits the grammar and equals plain decoding."""
    prompt = family.tokenize("yes no yes no yes no yes no yes no yes no", chat=False)
    sp = SamplingParams(temp=0.0, grammar='root ::= ("yes" | " yes")+ "."')
    plain = family.complete(prompt, 12, sp, speculative=False)
    fast = family.complete(prompt, 12, sp)
    assert fast.tokens == plain.tokens
    assert plain.text.replace(" yes", "yes").strip(".").replace("yes", "") == ""


def test_an_invalid_grammar_or_schema_is_a_usage_error(family):
    with pytest.raises(UsageError, match="not valid GBNF"):
        Grammar(family.target, 'root ::= "unterminated')
    with pytest.raises(UsageError, match="JSON schema"):
        schema_grammar({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
