"""--context-shift (issue 60, llama.cpp's test_ctx_shift and test_speculative::
test_with_ctx_shift): a full context drops the older half of what follows the first --keep
tokens and the generation goes on, with speculation: the target's cache, the context and
the draft's cache stay consistent, so greedy output with a draft is the target alone's,
shift for shift. Off (llama.cpp's default), a full context ends the generation, marked
truncated."""

from __future__ import annotations

import json

import pytest
from conftest import cli
from fakes import FakeModel
from test_serve import KEY, InProcess

from specli.config import DraftParams, ModelParams, NgramParams, SamplingParams
from specli.drafts import ModelDraft, NgramSimple
from specli.engine import Engine
from specli.plan import load

GREEDY = SamplingParams(temp=0.0)


def fake(draft=None, shift=True, n_keep=0) -> Engine:
    e = Engine(FakeModel(seed=5, n_ctx=64), draft, DraftParams(n_max=6))
    e.context_shift, e.n_keep = shift, n_keep
    return e


@pytest.mark.parametrize("draft", [lambda: ModelDraft(FakeModel(seed=5, noise=0.5, n_ctx=64)),
                                   lambda: NgramSimple(size_n=2, size_m=6), lambda: None],
                         ids=["model", "ngram", "none"])
@pytest.mark.parametrize("n_keep", [0, 5, -1])
def test_a_shifted_generation_is_the_target_alones_with_any_draft(draft, n_keep):
    prompt = list(range(1, 21))
    alone = fake(n_keep=n_keep).complete(prompt, 150, GREEDY, speculative=False)
    e = fake(draft(), n_keep=n_keep)
    out = e.complete(prompt, 150, GREEDY)
    assert out.tokens == alone.tokens and len(out.tokens) == 150
    assert out.stats.truncated and out.stats.n_shifts >= 3
    if e.draft is not None:
        assert out.stats.n_drafted > 0
    kept = 20 if n_keep < 0 else n_keep
    assert e.target.tokens[:kept] == prompt[:kept]  # the first n_keep tokens stay
    assert len(e.target.tokens) < 64


def test_without_context_shift_a_full_context_ends_the_generation_truncated():
    e = fake(ModelDraft(FakeModel(seed=5, noise=0.5, n_ctx=64)), shift=False)
    out = e.complete(list(range(1, 21)), 150, GREEDY)
    assert len(out.tokens) == 64 - 20 + 1 and out.stats.finish_reason == "length"
    assert out.stats.truncated and out.stats.n_shifts == 0


@pytest.fixture(scope="module")
def pair(f32, q4_1):
    """F32 target (greedy identity), Q4_1 draft, 256 tokens of context."""
    engines = {}
    for name, draft, types, ngram in (("alone", None, (), None), ("draft", q4_1, (), None),
                                      ("ngram", None, ("ngram-simple",),
                                       NgramParams(size_n=2, size_m=8))):
        engines[name] = load(ModelParams(f32, n_ctx=256, context_shift=True),
                             ModelParams(q4_1, n_ctx=256) if draft else None,
                             DraftParams(n_max=8), types, ngram)
    yield engines
    for e in engines.values():
        e.close()


@pytest.mark.slow
def test_a_shift_on_the_real_pair_keeps_the_target_alones_text(pair):
    """A 200-token prompt in 256 tokens of context, 120 tokens asked for: shifted once,
    the same tokens with a draft model, with n-gram drafts and alone."""
    prompt = pair["alone"].tokenize("Hello " * 200)
    assert len(prompt) >= 200
    alone = pair["alone"].complete(prompt, 120, GREEDY, speculative=False)
    assert len(alone.tokens) == 120 and alone.stats.truncated and alone.stats.n_shifts >= 1
    for name in ("draft", "ngram"):
        out = pair[name].complete(prompt, 120, GREEDY)
        assert out.tokens == alone.tokens, name
        assert out.stats.n_drafted > 0 and out.stats.n_shifts == alone.stats.n_shifts


def test_run_takes_llama_cpps_flags(q4_1):
    args = ["run", "-m", q4_1, "-c", "256", "-n", "270", "--temp", "0", "--ignore-eos",
            "-p", "Count: one two three", "--json"]
    on = json.loads(cli(*args, "--context-shift", "--keep", "-1").stdout)["stats"]
    off = json.loads(cli(*args).stdout)["stats"]
    assert on["n_predict"] == 270 and on["truncated"] and on["n_shifts"] >= 1
    assert off["n_predict"] < 256 and off["truncated"] and off["n_shifts"] == 0
    bad = cli(*args, "--keep", "-2")
    assert bad.returncode == 2 and "--keep must be -1" in bad.stderr


@pytest.fixture(scope="module")
def server(f32, q4_1):
    s = InProcess("-m", f32, "-md", q4_1, "-np", "1", "-c", "256", "--api-key", KEY,
                  "--draft", "8", "--context-shift")
    yield s
    s.stop()


@pytest.mark.slow
def test_the_server_shifts_and_says_truncated(server):
    """test_speculative::test_with_ctx_shift, and its stream: every token asked for."""
    body = {"prompt": "Hello " * 248, "temperature": 0.0, "top_k": 1, "n_predict": 256,
            "speculative.p_min": 0.0}
    with server.http() as h:
        r = h.post("/completion", json=body).json()
    assert r["tokens_predicted"] == 256 and r["truncated"] is True and r["content"]
    assert r["timings"]["draft_n"] > 0  # (the same text as alone: the engine's test above)
