"""A tiny deterministic stand-in for backend.Model, for fast tests of the loop's edge cases.

FakeModel is a bigram model over a small vocabulary, with a term for the position (so its
greedy path does not fall into a short cycle): the logits after a token are fixed rows of
seeded tables, so a decode is exact and batch-independent (unlike llama.cpp's), and
greedy speculative output must equal plain output token for token. A draft is the same table
plus noise, so it agrees with the target often but not always. Token 0 ends the generation.
Real-model tests (test_engine.py, test_parity.py) keep fidelity against llama.cpp itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np

from specli.backend import Model
from specli.drafts.base import Outcome
from specli.drafts.tree import Tree
from specli.errors import BackendError, ContextOverflowError

EOG = 0


class FakeModel:
    """Model's interface (decode, rewind, sync, tokens, timings, vocabulary) on a table."""

    def __init__(self, n_vocab: int = 32, seed: int = 0, noise: float = 0.0,
                 n_ctx: int = 256, n_batch: int = 64, eog_bias: float | None = None,
                 noise_seed: int = 1, spread: float = 2.0):
        # spread: how peaked each row's softmax is (a confident model has a large one)
        rng = np.random.default_rng(seed)
        table = rng.normal(0.0, spread, (n_vocab, n_vocab))
        by_pos = rng.normal(0.0, spread / 2, (61, n_vocab))  # 61: a prime period
        if noise:
            table += np.random.default_rng(noise_seed).normal(0.0, noise, table.shape)
        table[:, EOG] += -2 * spread if eog_bias is None else eog_bias  # rare, but reachable
        self.table, self.by_pos = table.astype(np.float32), by_pos.astype(np.float32)
        self.n_vocab, self.n_ctx, self.n_batch = n_vocab, n_ctx, n_batch
        self.params = SimpleNamespace(path=f"fake-{seed}", n_ctx=n_ctx)
        self.seq, self.load_ms, self.offloaded = 0, 0.0, False
        self.tokens: list[int] = []
        self.t_decode_s, self.n_decode_calls, self.n_decode_tokens = 0.0, 0, 0
        self.threads = ""  # no threads of its own (nothing to say in the statistics)
        self.fail_on_call: int | None = None  # the decode call number that raises
        self.n_branch = 1  # > 1: draft-tree branches (set by the tests that use them)
        self.cells: dict[int, dict[int, int]] = {}  # branch -> {position: token} past tokens
        self.keeps_hidden, self.last_rows = False, np.empty((0, n_vocab), dtype=np.float32)
        self.exported: tuple[tuple[int, ...], bool] = ((), False)

    # -- vocabulary: one token per character --------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        return [1 + ord(c) % (self.n_vocab - 1) for c in text]

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        return b"" if token == EOG else chr(ord("a") + token % 26).encode()

    max_token_bytes = 1  # one character a token

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def special_text(self, which: str) -> str:
        return ""

    def chat_template(self) -> str | None:
        return None

    def grammar(self, gbnf: str) -> FakeGrammar:
        return FakeGrammar(int(gbnf))

    # -- the cache ---------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], logits: str | int = "last") -> np.ndarray:
        n = len(tokens)
        if n == 0:
            raise BackendError("internal: decode of zero tokens")
        if len(self.tokens) + n > self.n_ctx:
            raise ContextOverflowError("context full")
        self.n_decode_calls += 1
        if self.fail_on_call == self.n_decode_calls:
            raise BackendError("decode failed (fake)")
        self.n_decode_tokens += n
        start = len(self.tokens)
        self.tokens.extend(tokens)
        n_out = min(int({"last": 1, "all": n, "none": 0}.get(logits, logits)), n)
        self.last_rows = self.rows_after(tokens, start)
        return self.last_rows[n - n_out:]

    def rows_after(self, tokens: Sequence[int], pos0: int) -> np.ndarray:
        """The logits that follow each token, the first at position pos0."""
        pos = np.arange(pos0, pos0 + len(tokens)) % len(self.by_pos)
        return self.table[np.asarray(tokens, dtype=np.int64)] + self.by_pos[pos]

    def rewind(self, n_keep: int) -> None:
        del self.tokens[n_keep:]

    def shift(self, n_keep: int, n_discard: int) -> bool:
        """The logits depend on (token, position): the tokens after the cut move back."""
        del self.tokens[n_keep:n_keep + n_discard]
        return True

    # -- draft trees: the logits depend on (token, position) only, so a node's row is exact ---
    def branch(self, seqs: Sequence[int]) -> None:
        for s in seqs:
            if s != 0:
                self.fork(0, s)

    def fork(self, src: int, dst: int) -> None:
        assert 0 <= src < self.n_branch and 0 < dst < self.n_branch, (src, dst)
        self.cells[dst] = dict(self.cells.get(src, {}))

    def decode_tree(self, tokens: Sequence[int], pos: Sequence[int],
                    seqs: Sequence[Sequence[int]]) -> np.ndarray:
        assert all(0 <= s < self.n_branch for ss in seqs for s in ss)
        assert all(p >= len(self.tokens) - 1 for p in pos), "a node inside the committed cache"
        self.n_decode_calls += 1
        if self.fail_on_call == self.n_decode_calls:
            raise BackendError("decode failed (fake)")
        self.n_decode_tokens += len(tokens)
        for t, p, ss in zip(tokens, pos, seqs, strict=True):
            for s in ss:
                self.cells.setdefault(s, {})[p] = t
        self.last_rows = np.stack([self.rows_after([t], p)[0]
                                   for t, p in zip(tokens, pos, strict=True)])
        return self.last_rows

    def keep(self, seq: int, tokens: Sequence[int]) -> None:
        """As llama.cpp would: what branch `seq` holds past the committed tokens must be
        the tokens kept (a wrong branch kept would be a wrong cache)."""
        held = self.cells.get(seq, {})
        for p in range(len(self.tokens), len(tokens)):
            assert held.get(p) == tokens[p], (seq, p, held, tokens[len(self.tokens):])
        self.cells.clear()
        self.tokens[:] = tokens

    sync = Model.sync  # the real one: it needs only tokens, rewind and decode

    def set_hidden(self, on: bool) -> None:
        self.keeps_hidden = on

    def hidden(self, n_out: int) -> np.ndarray:
        """A fake's hidden state is its logits row: what the last decode returned."""
        assert self.keeps_hidden, "hidden states read from a decode that kept none"
        return self.last_rows[-n_out:]

    def export(self, layers=(), nextn: bool = False, on: bool = True) -> None:
        self.exported = (tuple(layers), nextn) if on else ((), False)

    def layer_rows(self, layers, n_tokens: int) -> np.ndarray:
        """A fake's layer states are its logits rows, once per layer asked for."""
        assert set(layers) <= set(self.exported[0]), "layer states read that were not kept"
        return np.tile(self.last_rows[-n_tokens:], (1, len(layers)))

    def nextn_rows(self, n_tokens: int) -> np.ndarray:
        assert self.exported[1], "head states read from a decode that kept none"
        return np.array(self.last_rows[-n_tokens:])

    def kv_pos_max(self) -> int:
        return len(self.tokens) - 1

    def close(self) -> None:
        pass

    # -- the reference: what the target alone would generate ----------------------------------
    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        out, last = [], prompt[-1]
        for i in range(n):
            last = int(np.argmax(self.rows_after([last], len(prompt) - 1 + i)[0]))
            if last == EOG:
                break
            out.append(last)
        return out


class FakeGrammar:
    """backend.Grammar's interface on a rule: a token's residue mod `m` differs from the last
    accepted token's. Accepting a refused token raises, as llama.cpp would abort."""

    def __init__(self, m: int = 3, last: int = -1):
        self.m, self.last, self.closed = m, last, False
        self.accepted: list[int] = []

    def fork(self) -> FakeGrammar:
        return FakeGrammar(self.m, self.last)

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        assert not self.closed
        return np.asarray(ids) % self.m != self.last % self.m

    def accept(self, token: int) -> None:
        assert not self.closed
        if not self.allowed(np.array([token]))[0]:
            raise AssertionError(f"accepted token {token}, which the grammar refuses")
        self.last = token
        self.accepted.append(token)

    def close(self) -> None:
        self.closed = True


def accepted(n: int) -> Outcome:
    """A step whose verified proposal had its first n tokens accepted (its source's view)."""
    return Outcome(0, Tree.chain([1] * (n + 1)), list(range(n)), 1)
