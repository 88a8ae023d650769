"""The draft interface (llama.cpp's common_speculative: begin / propose / process / accept) on
the real F16 target: after every target decode the draft is told what the target decoded,
and it reads the target's hidden states when it asked for them at begin. This is what a
head (MTP, EAGLE-3) drafts from."""

from __future__ import annotations

import numpy as np
import pytest

from specli.backend import Model
from specli.config import DraftPolicy, ModelParams, SamplingParams
from specli.drafts.base import Reads
from specli.drafts.ngram import NgramSimple
from specli.engine import Engine
from specli.plan import load_slots

GREEDY = SamplingParams(temp=0.0)
# input-grounded: the n-gram source drafts often, so verification batches are long
PROMPT = ("Repeat exactly: the quick brown fox jumps over the lazy dog. "
          "the quick brown fox jumps over the lazy dog. the quick brown fox")


class Reader(NgramSimple):
    """An n-gram source that asks for the target's hidden states and records every batch it
    is told of, and every outcome."""

    def __init__(self, hidden: bool = True):
        super().__init__(2, 8)
        self.hidden, self.batches, self.outcomes = hidden, [], []

    def begin(self, prompt):
        super().begin(prompt)
        return Reads(hidden=self.hidden)

    def process(self, batch):
        self.batches.append((list(batch.tokens), list(batch.pos),
                             None if batch.hidden is None else np.array(batch.hidden)))

    def accept(self, outcome):
        super().accept(outcome)
        self.outcomes.append(outcome)


@pytest.fixture(scope="module")
def target(f16):
    m = Model(ModelParams(f16, n_ctx=512))
    yield m
    m.close()


def told(reader: Reader, engine: Engine, n: int):
    ids = engine.target.tokenize(PROMPT)
    engine.forget()  # the whole prompt is decoded, none of it reused from the last test
    out = engine.complete(ids, n, GREEDY)
    return ids, out


def test_the_draft_is_told_every_batch_the_target_decodes(target):
    reader = Reader()
    engine = Engine(target, reader, DraftPolicy())
    ids, out = told(reader, engine, 40)
    full = [*ids, *out.tokens]
    prompt_batches = [b for b in reader.batches if b[1][0] < len(ids) - 1]
    steps = reader.batches[len(prompt_batches):]
    # the prompt, as the target decoded it (its last token opens the first verification)
    assert [t for b in prompt_batches for t in b[0]] == ids[:-1]
    assert [p for b in prompt_batches for p in b[1]] == list(range(len(ids) - 1))
    # then one batch a step: the last committed token and the proposal, at their positions
    assert len(steps) == len(reader.outcomes) == out.stats.n_predict - out.stats.n_accept
    for (tokens, pos, _), o in zip(steps, reader.outcomes, strict=True):
        assert pos == list(range(pos[0], pos[0] + len(tokens)))
        assert tokens[0] == full[pos[0]]
        accepted = len(o.path)
        assert tokens[1:1 + accepted] == full[pos[0] + 1:pos[0] + 1 + accepted]
        assert o.n_keep == pos[0] + 1 + accepted
    assert out.stats.n_accept > 0 and max(len(b[0]) for b in steps) > 3


def test_hidden_states_are_the_targets_own_and_change_nothing(target, f16):
    plain = Engine(target).complete(target.tokenize(PROMPT), 40, GREEDY)
    reader = Reader()
    ids, out = told(reader, Engine(target, reader, DraftPolicy()), 40)
    assert out.tokens == plain.tokens  # keeping hidden states leaves the logits alone
    for tokens, _, hidden in reader.batches:
        assert hidden.shape == (len(tokens), target.n_embd) and np.isfinite(hidden).all()
    # the prompt's: exactly what the target computes for those tokens alone
    ref = Model(ModelParams(f16, n_ctx=512))
    try:
        ref.set_hidden(True)
        ref.decode(ids[:-1], logits="all")
        expected = np.array(ref.hidden(len(ids) - 1))
        # a verification batch's: the same as the reference decoding it after the same tokens
        tokens, pos, hidden = max(reader.batches[1:], key=lambda b: len(b[0]))
        ref.rewind(0)
        ref.decode([*ids, *out.tokens][:pos[0]], logits="none")
        ref.decode(tokens, logits="all")
        step = np.array(ref.hidden(len(tokens)))
    finally:
        ref.close()
    assert np.array_equal(reader.batches[0][2], expected)
    assert np.allclose(hidden, step, atol=1e-2), np.abs(hidden - step).max()
    assert not np.allclose(hidden[0], hidden[-1])  # a row per token, not one repeated


def test_a_draft_that_reads_nothing_gets_no_hidden_states(target):
    reader = Reader(hidden=False)
    told(reader, Engine(target, reader, DraftPolicy()), 16)
    assert reader.batches and all(b[2] is None for b in reader.batches)


def test_server_slots_read_their_own_hidden_states(f16):
    """Slots share one context: each gets a copy of its own rows, and a slot that reads
    nothing keeps nothing."""
    engines, shared = load_slots(2, ModelParams(f16, n_ctx=512))
    try:
        readers = [Reader(hidden=True), Reader(hidden=False)]
        for e, r in zip(engines, readers, strict=True):
            e.draft = r
        outs = [told(r, e, 24)[1] for e, r in zip(engines, readers, strict=True)]
        assert outs[0].tokens == outs[1].tokens
        hidden = [b[2] for b in readers[0].batches]
        assert all(h is not None and h.shape == (len(b[0]), engines[0].target.n_embd)
                   for h, b in zip(hidden, readers[0].batches, strict=True))
        assert all(b[2] is None for b in readers[1].batches)
        assert not shared[0]._hidden  # both generations are over: the context keeps none
    finally:
        for c in shared:
            c.close()


def test_a_lazy_draft_feeds_its_prompt_when_it_first_drafts(q4_1):
    """A server slot's draft under the batch's plan (ModelDraft.lazy) decodes nothing of the
    prompt at begin (under load the plan may never draft), keeps what its cache shares with
    the prompt, and catches up when it drafts: its proposal is the eager draft's."""
    from specli.drafts.base import Outcome
    from specli.drafts.model import ModelDraft

    eager_m, lazy_m = (Model(ModelParams(q4_1, n_ctx=256, n_threads=1)) for _ in range(2))
    try:
        prompt = Engine(eager_m).tokenize(PROMPT)
        eager, lazy = ModelDraft(eager_m), ModelDraft(lazy_m)
        lazy.lazy = True
        eager.begin(prompt)
        lazy.begin(prompt)
        assert eager_m.tokens == prompt[:-1] and lazy_m.tokens == []
        lazy.catch_up(prompt)
        assert lazy_m.tokens == prompt[:-1]
        rng = np.random.default_rng(0)
        want = eager.propose(prompt, 4, GREEDY, rng)
        got = lazy.propose(prompt, 4, GREEDY, rng)
        assert got.tokens == want.tokens and len(got.tokens) == 4
        lazy.accept(Outcome(len(prompt) + 2))
        again = [*prompt, *got.tokens[:2], 42]  # the next turn shares the first prompt
        lazy.begin(again)
        assert lazy_m.tokens == again[:-1]  # kept: the next proposal decodes only 42
    finally:
        eager_m.close()
        lazy_m.close()
