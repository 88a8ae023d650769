"""Drafts with another tokenizer (--spec-type draft-translate): the draft's proposal goes
through text into the target's tokens. Greedy output is the target's on the SmolLM2 + Gemma
pair in both directions (F16 targets), across characters split between tokens and when
the draft ends its answer; sampling keeps the target's distribution (a proposal is one-hot),
checked by chi-square on fake models whose vocabularies differ (one has two-letter tokens)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import PROMPTS, cli, once
from fakes import EOG, FakeModel
from test_cli import one_line_error
from test_sampling import N_SEEDS, SP, chi_square, exact_sequences

from specli.backend import quantize
from specli.config import DraftPolicy, ModelParams, SamplingParams
from specli.drafts.translate import TranslateDraft, _complete
from specli.engine import Engine
from specli.plan import load

GREEDY = SamplingParams(temp=0.0)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


class Letters(FakeModel):
    """A target whose token i (1..26) spells one letter; 0 ends the generation."""

    eos_token = EOG

    def __init__(self, **kw):
        super().__init__(n_vocab=27, **kw)

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        return b"" if token == EOG else LETTERS[token - 1].encode()

    def tokenize_bytes(self, data: bytes, add_special: bool = False,
                       parse_special: bool = False) -> list[int]:
        return [LETTERS.index(c) + 1 for c in bytes(data).decode()]

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        return self.tokenize_bytes(text.encode())


class Pieces(FakeModel):
    """A draft with another vocabulary: the letters in another order, and two-letter tokens
    (tokenized longest first). Its logits follow the target's table (plus noise), so it
    agrees with the target often but not always."""

    BIGRAMS = ("th", "he", "in", "er", "an", "re", "on", "at", "en", "nd")

    def __init__(self, target: Letters, noise: float = 1.0):
        order = np.random.default_rng(3).permutation(26)
        self.pieces = ["", *(LETTERS[i] for i in order), *self.BIGRAMS, " ", "\n"]
        super().__init__(n_vocab=len(self.pieces))
        rng = np.random.default_rng(4)
        n = self.n_vocab
        table = np.full((n, n), -4.0, dtype=np.float32)  # two-letter tokens: rarely drafted
        for a, pa in enumerate(self.pieces):
            prev = LETTERS.index(pa[-1]) + 1 if pa and pa[-1] in LETTERS else EOG
            for b, pb in enumerate(self.pieces):
                if pb == "" or (len(pb) == 1 and pb in LETTERS):  # the end, or a letter
                    nxt = LETTERS.index(pb) + 1 if pb else EOG
                    table[a, b] = target.table[prev, nxt] + rng.normal(0.0, noise)
        table[:, [self.pieces.index(" "), self.pieces.index("\n")]] = -1e9  # never drafted
        self.table = table
        self.by_pos = np.zeros_like(self.by_pos[:, :n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        return self.pieces[token].encode()

    def tokenize_bytes(self, data: bytes, add_special: bool = False,
                       parse_special: bool = False) -> list[int]:
        text, out, i = bytes(data).decode(), [], 0
        while i < len(text):
            two = text[i:i + 2]
            if len(two) == 2 and two in self.pieces:
                out.append(self.pieces.index(two))
                i += 2
            else:
                out.append(self.pieces.index(text[i]))
                i += 1
        return out


class SpacedPieces(Pieces):
    """Pieces with SentencePiece's add_space_prefix: a space before any text tokenized."""

    def tokenize_bytes(self, data: bytes, add_special: bool = False,
                       parse_special: bool = False) -> list[int]:
        return [self.pieces.index(" "), *super().tokenize_bytes(data)]


def fake_engine(k: int = 4, draft=Pieces) -> Engine:
    target = Letters(seed=5)
    return Engine(target, TranslateDraft(draft(target), target), DraftPolicy(n_max=k))


def test_greedy_translation_equals_plain_on_the_fake():
    e = fake_engine()
    for text in ["theanswerisin", "onceuponatime", "x"]:
        prompt = e.target.tokenize(text)
        plain = e.complete(prompt, 60, GREEDY, speculative=False)
        out = e.complete(prompt, 60, GREEDY)
        assert out.tokens == plain.tokens
        assert out.stats.n_accept > 0 and out.stats.n_accept < out.stats.n_drafted


def test_a_tokenizer_that_adds_a_leading_space_still_translates():
    """Without the newline it is given to put its space on, every re-tokenized piece would
    spell an extra space and no proposal would ever match the committed text."""
    e = fake_engine(draft=SpacedPieces)
    prompt = e.target.tokenize("theanswerisin")
    plain = e.complete(prompt, 60, GREEDY, speculative=False)
    out = e.complete(prompt, 60, GREEDY)
    assert out.tokens == plain.tokens
    assert out.stats.n_accept > 0


@pytest.mark.slow
def test_translated_proposals_keep_the_target_distribution():
    e = fake_engine(k=3)
    prompt = e.target.tokenize("thethreeprimarycoloursarered")
    exact = exact_sequences(e, prompt, 3)
    runs, drafted, accepted = [], 0, 0
    for seed in range(N_SEEDS):
        out = e.complete(prompt, 3, SamplingParams(**{**SP.__dict__, "seed": seed}))
        runs.append(tuple(out.tokens))
        drafted, accepted = drafted + out.stats.n_drafted, accepted + out.stats.n_accept
    assert 0.05 < accepted / drafted < 0.99
    first = Counter(r[:1] for r in runs)
    exact1: dict = {}
    for seq, p in exact.items():
        exact1[seq[:1]] = exact1.get(seq[:1], 0.0) + p
    assert chi_square(first, exact1, N_SEEDS) > 0.01
    assert chi_square(Counter(runs), exact, N_SEEDS) > 0.01


def test_a_character_split_between_bytes_waits_for_its_end():
    assert _complete("café".encode()) == len("café".encode())
    assert _complete("café".encode()[:-1]) == len(b"caf")
    assert _complete("a☕".encode()[:-1]) == 1 and _complete("a☕".encode()[:-2]) == 1
    assert _complete(b"") == 0


# -- the real pair: SmolLM2 (gpt2 BPE, 49k) and Gemma 3 (SentencePiece, 262k) ---------------

@pytest.fixture(scope="module")
def gemma_f16(gemma, model_dir) -> str:
    out = model_dir / "gemma-3-270m.F16.gguf"
    with once(model_dir):
        if not out.is_file():
            quantize(gemma, str(out), "f16")
    return str(out)


@pytest.fixture(scope="module")
def smollm2_target(f16, gemma):
    e = load(ModelParams(f16), ModelParams(gemma), DraftPolicy(n_max=6, translate=True))
    yield e
    e.close()


@pytest.fixture(scope="module")
def gemma_target(gemma_f16, q4_1):
    e = load(ModelParams(gemma_f16), ModelParams(q4_1), DraftPolicy(n_max=6, translate=True))
    yield e
    e.close()


def test_gemma_drafts_for_smollm2_and_the_text_is_the_targets(smollm2_target):
    e = smollm2_target
    for prompt in PROMPTS[:2]:
        ids, own = e.prompt(prompt, chat=True)
        plain = e.complete(ids, 48, GREEDY, speculative=False)
        out = e.complete(ids, 48, GREEDY, draft_prompt=own)
        assert out.tokens == plain.tokens
        assert out.stats.n_accept > 0, "some translated drafts are accepted"
        assert out.stats.per_source["draft-translate"]["gen_drafts"] > 0


def test_smollm2_drafts_for_gemma_and_the_text_is_the_targets(gemma_target):
    e = gemma_target
    ids = e.tokenize("The history of the printing press begins in")
    plain = e.complete(ids, 48, GREEDY, speculative=False)
    out = e.complete(ids, 48, GREEDY)
    assert out.tokens == plain.tokens
    assert out.stats.n_accept > 0


def test_characters_split_between_tokens(smollm2_target):
    """SmolLM2's byte-level tokens split CJK characters: the draft sees whole characters,
    proposals start and end on them, and the output is still the target's."""
    e = smollm2_target
    ids, own = e.prompt("Translate into Japanese: good morning, thank you, see you tomorrow.",
                        chat=True)
    plain = e.complete(ids, 48, GREEDY, speculative=False)
    out = e.complete(ids, 48, GREEDY, draft_prompt=own)
    assert out.tokens == plain.tokens
    pieces = [e.target.token_bytes(t) for t in plain.tokens]
    split = [p for p in pieces if p and _complete(p) < len(p)]
    assert split, "the answer must hold a character split between tokens"
    assert out.stats.n_accept > 0


def test_the_drafts_end_of_generation_becomes_the_targets(gemma_target, monkeypatch):
    """SmolLM2 answers briefly and ends its turn; its end of generation is proposed as
    Gemma's end-of-sequence token, which Gemma verifies like any other."""
    e = gemma_target
    proposals = []
    real = TranslateDraft.propose

    def spy(self, *args, **kw):
        p = real(self, *args, **kw)
        proposals.append(p.tokens)
        return p

    monkeypatch.setattr(TranslateDraft, "propose", spy)
    ids, own = e.prompt("Reply with one word: what colour is the sky?", chat=True)
    plain = e.complete(ids, 40, GREEDY, speculative=False)
    out = e.complete(ids, 40, GREEDY, draft_prompt=own)
    assert out.tokens == plain.tokens
    assert any(p and p[-1] == e.target.eos_token for p in proposals), proposals


def test_the_drafts_prompt_travels_with_the_request(gemma_target, monkeypatch):
    """A chat's draft prompt (the draft's own rendering of it) is the generation's argument,
    not the engine's state: past 64 chats tokenized at once (a busy server's), the first
    still reaches the draft through the draft's template (the engine once kept the last 64
    in a dict shared by every slot)."""
    e = gemma_target
    chats = [e.prompt(f"Reply with one word: what colour is thing {i}?", chat=True)
             for i in range(70)]
    seen = []
    real = TranslateDraft.begin

    def spy(self, prompt):
        seen.append(self.draft_prompt)
        return real(self, prompt)

    monkeypatch.setattr(TranslateDraft, "begin", spy)
    e.complete(chats[0][0], 2, GREEDY, draft_prompt=chats[0][1])
    assert seen == [chats[0][1]] and seen[0]
    # SmolLM2's own template, not Gemma's turn markers
    assert "<|im_start|>" in "".join(e.draft_model.token_bytes(t, special=True).decode()
                                     for t in seen[0])


def test_run_translates_where_llama_cpp_refuses(f16, gemma):
    fast = ("-m", f16, "-md", gemma, "-p", PROMPTS[0], "--chat", "-n", "16", "--temp", "0")
    refused = cli("run", *fast)
    one_line_error(refused, 1, "incompatible", "draft-translate")
    plain = cli("run", *fast, "--no-spec")
    for flags in (("--spec-type", "draft-translate"), ("--draft-translate",)):
        r = cli("run", *fast, *flags)
        assert r.returncode == 0, r.stderr
        assert r.stdout == plain.stdout
        assert "statistics draft-translate:" in r.stderr


def test_check_pair_says_translation_can_run_it(f16, gemma):
    r = cli("check-pair", f16, gemma)
    assert r.returncode == 1
    assert "--spec-type draft-translate" in r.stdout


def test_serve_translates_for_the_openai_client(f16, gemma):
    from test_serve import KEY, InProcess

    # --draft 8: serve's default (auto) would rightly never draft with a draft twice the
    # target's size; this test is about translation
    s = InProcess("-m", f16, "-md", gemma, "--spec-type", "draft-translate", "-np", "2",
                  "-c", "1024", "--api-key", KEY, "--temp", "0", "--draft", "8")
    try:
        client = s.client()

        def ask(**kw):
            return client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=32,
                temperature=0, **kw)

        base, spec = ask(extra_body={"speculative": False}), ask()
        assert spec.choices[0].message.content == base.choices[0].message.content
        assert spec.usage.model_extra["speculative"]["draft_n_accepted"] > 0
    finally:
        s.stop()
