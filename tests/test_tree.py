"""Draft trees (-np/--draft-n-seq > 1, llama-speculative's branches): greedy output is the
target's, sampling keeps the target's distribution (SpecInfer's multi-draft rule), a rejected
tree still emits the target's token, and both caches end as a fresh decode of what was kept.

The distribution tests run on the fake model (2,000 seeds in seconds), where the logits
depend on (token, position) only, so a tree's rows are exact; fidelity and the caches are
also checked on the real SmolLM2 family."""

from __future__ import annotations

import json
import threading
from collections import Counter

import numpy as np
import pytest
from conftest import PROMPTS, cli
from fakes import FakeModel
from test_cli import one_line_error
from test_sampling import N_SEEDS, SP, chi_square, exact_sequences
from test_serve import KEY, InProcess

from specli import verify
from specli.backend import Model
from specli.config import SPEC_SAMPLING, DraftPolicy, ModelParams, SamplingParams
from specli.drafts import ModelDraft
from specli.drafts.tree import ROOT, Tree
from specli.engine import Engine
from specli.errors import UsageError
from specli.plan import load
from specli.stats import Stats, format_llama
from specli.verify import verify_tree

GREEDY = SamplingParams(temp=0.0)


def fake_tree_engine(n_seq: int, noise: float = 1.5, p_split: float = 0.05, k: int = 6,
                     draft_seed: int = 5, sampling: str = "exact") -> Engine:
    target, draft = FakeModel(seed=5), FakeModel(seed=draft_seed, noise=noise)
    target.n_branch = draft.n_branch = n_seq
    return Engine(target, ModelDraft(draft), DraftPolicy(n_max=k, n_seq=n_seq, p_split=p_split,
                                                         sampling=sampling))


@pytest.mark.parametrize("n_seq", [2, 4])
def test_greedy_tree_equals_plain_on_the_fake(n_seq):
    e = fake_tree_engine(n_seq)
    for text in ["The three primary colours are red,", "Once upon a time", "x = [1, 2,"]:
        prompt = e.tokenize(text)
        plain = e.complete(prompt, 80, GREEDY, speculative=False)
        tree = e.complete(prompt, 80, GREEDY)
        assert tree.tokens == plain.tokens
        s = tree.stats
        assert s.n_branches > s.n_steps, "the trees must branch for this to test anything"
        assert s.n_seq_dft == n_seq and s.n_drafted > s.n_depths  # nodes beyond one path


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SPEC_SAMPLING)
@pytest.mark.parametrize("n_seq", [2, 4])
def test_tree_sampling_keeps_the_first_three_tokens_distribution(n_seq, sampling):
    e = fake_tree_engine(n_seq, k=4, sampling=sampling)
    prompt = e.tokenize("The three primary colours are red,")
    exact = exact_sequences(e, prompt, 3)
    runs, branches, steps, accepted = [], 0, 0, 0
    for seed in range(N_SEEDS):
        out = e.complete(prompt, 3, SamplingParams(**{**SP.__dict__, "seed": seed}))
        runs.append(tuple(out.tokens))
        branches, steps = branches + out.stats.n_branches, steps + out.stats.n_steps
        accepted += out.stats.n_accept
    assert branches > 1.2 * steps, "the trees must branch for this to test anything"
    assert 0.2 < accepted / steps < 2.5, "some drafts accepted, some rejected"
    assert chi_square(Counter(r[:1] for r in runs), exact_first(exact), N_SEEDS) > 0.01
    assert chi_square(Counter(runs), exact, N_SEEDS) > 0.01


def exact_first(exact: dict) -> dict:
    out: dict = {}
    for seq, p in exact.items():
        out[seq[:1]] = out.get(seq[:1], 0.0) + p
    return out


@pytest.mark.slow
def test_the_tree_check_catches_a_residual_that_is_not_recursive(monkeypatch):
    """After a rejected draw the next one must be judged against norm(max(0, r - q)); judging
    every draw against p itself accepts the drafts too often, and the check says so."""
    e = fake_tree_engine(4, k=4, draft_seed=6, noise=0.0, sampling="rejection")
    monkeypatch.setattr(verify, "residual", lambda p, q, drafted: p)
    prompt = e.tokenize("The three primary colours are red,")
    exact = exact_first(exact_sequences(e, prompt, 1))
    runs = [tuple(e.complete(prompt, 2, SamplingParams(**{**SP.__dict__, "seed": s})).tokens)
            for s in range(N_SEEDS)]
    assert chi_square(Counter(r[:1] for r in runs), exact, N_SEEDS) < 0.01


def test_a_tree_whose_every_branch_is_rejected_emits_the_targets_token():
    tree = Tree()
    a, b = tree.add(ROOT, 3, 0), tree.add(ROOT, 4, 1)
    tree.add(a, 5, 0)
    rows = np.zeros((4, 8), dtype=np.float32)
    rows[0, 6] = 1.0  # the target wants 6 after the root: neither 3 nor 4
    path, token = verify_tree(tree, lambda r, path: rows[r], GREEDY, np.random.default_rng(0))
    assert (path, token) == ([], 6)
    rows[0, 4], rows[2, 1] = 2.0, 1.0  # now it wants 4 (branch b, a leaf), then 1
    path, token = verify_tree(tree, lambda r, path: rows[r], GREEDY, np.random.default_rng(0))
    assert (path, token) == ([b], 1)
    # on the engine: a draft that never agrees; every step keeps no node and still emits
    e = fake_tree_engine(3, draft_seed=11, noise=0.0)
    prompt = e.tokenize("Once upon a time")
    out = e.complete(prompt, 40, GREEDY)
    assert out.tokens == e.complete(prompt, 40, GREEDY, speculative=False).tokens
    assert out.stats.n_accept < out.stats.n_steps  # steps that accepted nothing


def test_a_failure_mid_tree_leaves_the_caches_committed():
    e = fake_tree_engine(4)
    prompt = e.tokenize("Once upon a time")
    reference = e.complete(prompt, 30, GREEDY, speculative=False).tokens
    e.target.fail_on_call = e.target.n_decode_calls + 4
    emitted = list(prompt)
    with pytest.raises(Exception, match="decode failed"):
        for token, _ in e.steps(prompt, 30, GREEDY, Stats()):
            emitted.append(token)
    assert e.target.tokens == emitted[:-1]
    assert e.draft.model.tokens == emitted[: len(e.draft.model.tokens)]
    e.target.fail_on_call = None
    assert e.complete(prompt, 30, GREEDY).tokens == reference


def test_trees_are_refused_where_they_cannot_run(f32, q4_1):
    with pytest.raises(UsageError, match="need a draft model"):
        load(ModelParams(f32), None, DraftPolicy(n_seq=2))
    with pytest.raises(UsageError, match="model alone"):
        load(ModelParams(f32), ModelParams(q4_1), DraftPolicy(n_seq=2),
                    spec_types=("ngram-simple", "draft-simple"))
    with pytest.raises(UsageError, match="takes a fixed n_max, not auto"):
        load(ModelParams(f32), ModelParams(q4_1), DraftPolicy(n_seq=2, adaptive=True))
    with pytest.raises(UsageError, match="n_seq must be between 1 and 64"):
        load(ModelParams(f32), ModelParams(q4_1), DraftPolicy(n_seq=0))
    with pytest.raises(UsageError, match="p_split must be between 0 and 1"):
        load(ModelParams(f32), ModelParams(q4_1), DraftPolicy(n_seq=2, p_split=1.5))


@pytest.fixture(scope="module")
def tree4(f32, q2_k):
    """A weak draft (SmolLM2 requantized to Q2_K: about a third accepted), so trees branch."""
    e = load(ModelParams(f32), ModelParams(q2_k),
                    DraftPolicy(n_max=8, n_seq=4, p_split=0.05))
    yield e
    e.close()


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_tree_equals_plain_on_f32_target(tree4, prompt):
    ids = tree4.tokenize(prompt, chat=True)
    plain = tree4.complete(ids, 64, GREEDY, speculative=False)
    fast = tree4.complete(ids, 64, GREEDY)
    assert fast.tokens == plain.tokens
    assert fast.stats.n_branches > fast.stats.n_steps
    block = format_llama(fast.stats)
    assert "draft tree = 4 sequences" in block and "accepted path = " in block


def test_tree_rewind_leaves_both_caches_as_a_fresh_decode(tree4, f32):
    """After a step that kept a branch other than the first, each cache holds only sequence 0,
    exactly the committed tokens, and the next row equals a fresh context's."""
    ids = tree4.tokenize(PROMPTS[7], chat=True)
    seen = []
    real_keep = tree4.target.keep

    def keep(seq, tokens):
        seen.append(seq)
        real_keep(seq, tokens)

    tree4.target.keep = keep
    try:
        gen = tree4.steps(ids, 200, GREEDY, Stats())
        context = list(ids)
        for token, _ in gen:
            context.append(token)
            if seen and seen[-1] > 0 and len(tree4.target.tokens) == len(context) - 1:
                break
        gen.close()
    finally:
        del tree4.target.keep
    assert seen and seen[-1] > 0, "no step kept another branch in 200 tokens"
    for m in (tree4.target, tree4.draft.model):
        n = len(m.tokens)
        assert m.seq_pos_range(0) == (0, n - 1)
        assert all(m.seq_pos_range(s) == (-1, -1) for s in range(1, 4))
        assert m.tokens == context[:n]
    after = tree4.target.decode([context[-1]])[0].copy()
    tree4.target.rewind(len(context) - 1)
    fresh = Model(ModelParams(f32))
    fresh.sync(context[:-1])
    expected = fresh.decode([context[-1]])[0]
    # batched and single-token decodes of one F32 text differ by up to ~0.015 here
    np.testing.assert_allclose(after, expected, atol=2e-2)
    assert int(np.argmax(after)) == int(np.argmax(expected))
    fresh.close()


def test_serve_drafts_trees_in_every_slot(f32, q2_k):
    """`serve --draft-n-seq`: each slot drafts a tree in its own sequences of the shared
    contexts; two requests at once get the target's own greedy text."""
    s = InProcess("-m", f32, "-md", q2_k, "-np", "2", "-c", "1024",
                  "--api-key", KEY, "--temp", "0", "--draft-n-seq", "3",
                  "--draft-p-split", "0.05")
    try:
        client = s.client()
        prompts = PROMPTS[:2]
        base = {p: client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": p}], max_tokens=40,
            temperature=0, extra_body={"speculative": False}).choices[0].message.content
            for p in prompts}
        got: dict = {}

        def ask(p: str) -> None:
            got[p] = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": p}], max_tokens=40,
                temperature=0)

        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for p in prompts:
            assert got[p].choices[0].message.content == base[p]
        spec = [got[p].usage.model_extra["speculative"] for p in prompts]
        assert all(x["n_seq"] == 3 for x in spec)
        assert sum(x["branches"] for x in spec) > sum(x["drafts"] for x in spec)
        # a request's own tree, narrower than the server's: the same text
        own = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompts[0]}], max_tokens=40,
            temperature=0, extra_body={"speculative": {"n_seq": 2, "p_split": 0.1}})
        assert own.choices[0].message.content == base[prompts[0]]
        assert own.usage.model_extra["speculative"]["n_seq"] == 2
    finally:
        s.stop()


def test_run_np_draws_a_tree_and_prints_its_lines(f32, q2_k):
    """`specli run -np N` (llama-speculative's spelling) and `--draft-n-seq N`: the text is the
    target's, the statistics block says what the tree did, --json has the same figures."""
    fast = ("-m", f32, "-md", q2_k, "-p", PROMPTS[1], "--chat", "-n", "24", "--temp", "0",
            "--draft-p-split", "0.05")
    plain = cli("run", *fast, "--no-spec", "-np", "3")
    tree = cli("run", *fast, "-np", "3")
    assert plain.returncode == tree.returncode == 0, tree.stderr
    assert tree.stdout == plain.stdout
    assert "draft tree = 3 sequences" in tree.stderr and "accepted path = " in tree.stderr
    doc = json.loads(cli("run", *fast, "--draft-n-seq", "3", "--json").stdout)
    s = doc["stats"]
    assert s["n_seq_dft"] == 3 and s["n_branches"] >= s["n_steps"] > 0
    assert s["n_drafted"] >= s["n_depths"] and s["max_path"] >= 0


@pytest.mark.parametrize("args,needle", [
    (("-np", "2"), "need a draft model"),
    (("-np", "0", "-md", "{q4_1}"), "-np/--parallel must be between 1 and 64"),
    (("--draft-n-seq", "2", "--draft", "auto", "-md", "{q4_1}"), "takes a fixed --draft"),
    (("--draft-p-split", "1.5"), "--draft-p-split must be between 0 and 1"),
    (("-np", "2", "-md", "{q4_1}", "--spec-type", "ngram-simple,draft-simple"),
     "draft with the model alone"),
])
def test_tree_flags_are_one_line_usage_errors(f32, q4_1, args, needle):
    r = cli("run", "-m", f32, *(a.format(q4_1=q4_1) for a in args), "-n", "4")
    one_line_error(r, 2, needle)
