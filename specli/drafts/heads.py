"""Draft heads: drafters that read the target's hidden states after every verification
(llama.cpp's common/speculative.cpp: draft-mtp, draft-eagle3, draft-dflash, draft-dspark).

Each runs in a backend.HeadContext beside the target's context. After every target decode it
is told what was decoded with the states it asked for at `begin` (process): an MTP head the
target's next-token-head state per token, an EAGLE-3 or DFlash head the inputs of chosen target
layers. Its cache follows the target's committed tokens (`HeadContext.tokens`), so a prompt
that shares a prefix with the last one is not decoded again, except the last shared token when
the head needs the target's state there (Reads.redo). What a verification told is written into
the head's cache at accept, once the target has said how much of it it kept: rejected tokens
are never encoded (llama.cpp's process writes the whole batch and drops them after).

As in llama.cpp, a head drafts its top token at every position (a deterministic proposal,
at any temperature: rejection sampling keeps the target's distribution), and p_min is judged
on the softmax of its top ten logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from specli.backend.heads import HeadContext
from specli.config import DraftPolicy, SamplingParams
from specli.drafts.base import Decoded, DraftSource, Outcome, Reads, top_share
from specli.drafts.tree import Tree
from specli.verify import finite_argmax, finite_argmaxes


def _top(logits: np.ndarray, p_min: float) -> tuple[int, float]:
    """The top token and, when p_min asks, its probability among the top ten (llama.cpp's p
    for p_min; 1.0 otherwise)."""
    token = finite_argmax(logits)
    return token, top_share(logits, token) if p_min > 0.0 else 1.0


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class _Head(DraftSource):
    """What every head shares: the context, its vocabulary cap, the prompt's reuse, and the
    write of what the target decoded into the head's cache once the step is over."""

    def __init__(self, head: HeadContext, n_vocab_target: int):
        self.model = head
        self.n_vocab = min(head.n_vocab, n_vocab_target)
        self.told: Decoded | None = None  # the last batch, not yet written into the cache

    def top(self, i: int, p_min: float = 0.0) -> tuple[int, float]:
        return _top(self.model.logits(i)[: self.n_vocab], p_min)

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator, policy: DraftPolicy | None = None,
                rules=None) -> Tree:
        """Up to k of its top tokens after `context` (p_min from the policy); the cells it
        drafted into are dropped after (the verification brings its own)."""
        out: list[int] = []
        n_past = len(context) - 1
        self._take()
        try:
            if k > 0:
                self._draft(context, n_past, k, policy.p_min if policy else 0.0, out)
        finally:
            self.model.rewind_cells(n_past)
        return Tree.chain(out, source=self.name)

    def process(self, batch: Decoded) -> None:
        """Kept until it is known how many of its rows the target kept (accept), so that a
        verification's rejected rows are never written. A batch that no accept follows (the
        prompt's) was all kept: it is written before the next batch, draft, begin or end."""
        self._take()
        self.told = batch

    def _take(self, n_keep: int | None = None) -> None:
        """Write the told batch's rows before position n_keep (all of them: None). A write
        that fails leaves `tokens` and the seed as they were (the next begin drops any cell
        past them)."""
        batch, self.told = self.told, None
        if batch is None:
            return
        n = len(batch.tokens) if n_keep is None else min(len(batch.tokens),
                                                         n_keep - batch.pos[0])
        if n > 0:
            self._write(batch, n)

    def _write(self, batch: Decoded, n: int) -> None:
        """The batch's first n rows into the head's cache, the head's own way."""
        raise NotImplementedError

    def _chain(self, items: list, k: int, p_min: float, out: list[int],
               after: Callable[[int, int, np.ndarray], list],
               before: Callable[[int], None] | None = None) -> None:
        """The MTP and EAGLE-3 heads' draft loop, a token per decode: decode `items`, take
        the last row's top token into `out` (one under p_min stops it, as k does), then
        after(i, token, its state) gives the next decode's items; before(i), if given, runs
        before each decode."""
        m = self.model
        for i in range(k):
            if before is not None:
                before(i)
            m.run(items)
            token, p = self.top(len(items) - 1, p_min)
            state = m.nextn(len(items) - 1)
            if p < p_min:
                return
            out.append(token)
            if len(out) >= k:
                return
            items = after(i, token, state)

    def accept(self, outcome: Outcome) -> None:
        """The told rows the target kept into the cache (MTP's pending state and EAGLE-3's
        seed become the last kept token's), the rest dropped."""
        self._take(outcome.n_keep)
        self.model.rewind(outcome.n_keep)

    def end(self) -> None:
        self._take()


class MtpDraft(_Head):
    """The target's own multi-token-prediction layers (llama.cpp's draft-mtp). Its cache
    holds, at position p, token p with the target's state at p - 1. One head drafts every
    token from its own state; several heads (n_heads > 1) draft one token each, the whole
    draft decoded again through each. A head that attends over the target's own cache (a
    Gemma 4 assistant: HeadContext.shares_memory) has no cache to fill, and drafts every
    token at the position after the target's last, from its own state."""

    name = "draft-mtp"

    def __init__(self, head: HeadContext, n_heads: int, n_vocab_target: int):
        super().__init__(head, n_vocab_target)
        self.shared = head.shares_memory
        self.n_heads = 1 if self.shared else max(1, n_heads)  # its heads run in one graph
        head.export_nextn(True, masked=True)
        self.pending: np.ndarray | None = np.zeros(head.n_state, np.float32)  # state at p-1

    def begin(self, prompt: Sequence[int]) -> Reads:
        m = self.model
        self._take()
        n = _shared(m.tokens, prompt[:-1])
        if n < len(m.tokens):  # the target's state before position n is gone: decode
            m.rewind(n)        # its last shared token again (its cell here stays)
            self.pending = None
        if n == 0:
            self.pending = np.zeros(m.n_state, np.float32)  # as llama.cpp starts
        return Reads(nextn=True, redo=n - 1 if self.pending is None else n)

    def _write(self, batch: Decoded, n: int) -> None:
        """The first n tokens, each with the target's state before it, into the cache."""
        m, s = self.model, batch.pos[0]
        skip = 1 if self.pending is None else 0  # its cell is held: the state is the batch's
        m.rewind(s + skip)
        items = [(batch.tokens[i], batch.pos[i], batch.nextn[i - 1] if i else self.pending,
                  False) for i in range(skip, n)]
        if items and not self.shared:  # a shared cache holds the target's decode already
            self._decode(items)
        m.tokens.extend(batch.tokens[skip:n])
        self.pending = batch.nextn[n - 1]

    def _decode(self, items: list) -> None:
        m = self.model
        if self.n_heads == 1:
            m.run(items)
            return
        for head in range(self.n_heads):  # every head's cache layer gets the batch
            m.rewind_cells(items[0][1])
            m.layer_offset(head)
            m.run(items)
        m.layer_offset(0)

    def _draft(self, context: Sequence[int], n_past: int, k: int, p_min: float,
               out: list[int]) -> None:
        m = self.model
        k = min(k, self.n_heads) if self.n_heads > 1 else k
        if self.pending is None:
            return
        states = [self.pending]

        def head(i: int) -> None:  # several heads: the draft goes through head i
            m.rewind_cells(n_past)
            m.layer_offset(i)

        def after(i: int, token: int, state: np.ndarray) -> list:
            if self.n_heads > 1:  # the whole draft again, through the next head
                states.append(state)
                seq = [context[-1], *out]
                return [(t, n_past + j, states[j], j == len(seq) - 1)
                        for j, t in enumerate(seq)]
            # a shared cache: llama.cpp drafts at one position, as transformers
            return [(token, n_past if self.shared else n_past + i + 1, state, True)]

        try:
            self._chain([(context[-1], n_past, self.pending, True)], k, p_min, out, after,
                        head if self.n_heads > 1 else None)
        finally:
            if self.n_heads > 1:
                m.layer_offset(0)


class Eagle3Draft(_Head):
    """An EAGLE-3 head (llama.cpp's draft-eagle3): the target's states at three layers go
    through the head's encoder (g); its cache holds, at position p, token p + 1 with g at p,
    and it drafts from its own state, a token per decode."""

    name = "draft-eagle3"

    def __init__(self, head: HeadContext, layers: Sequence[int], n_vocab_target: int):
        super().__init__(head, n_vocab_target)
        self.layers = tuple(layers)
        head.export_nextn(True, masked=True)
        self.pending: tuple[int, np.ndarray] | None = None  # (position, g) not yet cached

    def begin(self, prompt: Sequence[int]) -> Reads:
        m = self.model
        self._take()
        n = _shared(m.tokens, prompt[:-1])
        if n < len(m.tokens) or self.pending is None:  # token n - 1's g is gone: the
            m.rewind(max(n - 1, 0))                      # target decodes it again
            self.pending = None
        return Reads(layers=self.layers, redo=len(m.tokens))

    def _write(self, batch: Decoded, n: int) -> None:
        """The first n rows through the encoder; tokens 1..n-1 cached with their g, after
        the seed's cell (the batch's first token with the seed's g) when no draft wrote it:
        the cache has no gap for the next decode to refuse."""
        m, s = self.model, batch.pos[0]
        g = np.empty((n, m.n_embd), np.float32)
        base = m.pos_max() + 1
        for a in range(0, n, m.n_ubatch):  # the encoder takes one ubatch at a time
            b = min(a + m.n_ubatch, n)
            m.run([(None, base + i, batch.layers[i], True) for i in range(a, b)], encode=True)
            g[a:b] = m.nextn_rows(b - a)
        m.rewind(s)
        items = [(batch.tokens[i + 1], batch.pos[i], g[i], False) for i in range(n - 1)]
        if self.pending is not None and self.pending[0] == s - 1 and m.pos_max() < s - 1:
            items.insert(0, (batch.tokens[0], s - 1, self.pending[1], False))
        if items:
            m.run(items)
        m.tokens.extend(batch.tokens[:n])
        self.pending = (batch.pos[n - 1], g[n - 1])

    def _draft(self, context: Sequence[int], n_past: int, k: int, p_min: float,
               out: list[int]) -> None:
        """From the seed (the last token with g at the position before it, whose cell stays
        after), a token per decode."""
        m = self.model
        if self.pending is None:
            return
        pos, g = self.pending
        m.rewind_cells(pos)
        self._chain([(context[-1], pos, g, True)], k, p_min, out,
                    lambda i, token, state: [(token, pos + i + 1, state, True)])


class DflashDraft(_Head):
    """A DFlash block-diffusion drafter (llama.cpp's draft-dflash), or DSpark with its Markov
    head (draft-dspark): the target's layer states are written into its cache as keys and
    values at their positions; a draft is one non-causal decode of [last token, mask, ...]."""

    def __init__(self, head: HeadContext, layers: Sequence[int], n_vocab_target: int, *,
                 block_size: int, mask: int, dspark: bool = False,
                 from_anchor: bool = True):
        super().__init__(head, n_vocab_target)
        self.name = "draft-dspark" if dspark else "draft-dflash"
        self.layers, self.mask = tuple(layers), mask
        self.dspark, self.from_anchor = dspark, from_anchor
        self.anchor = dspark and from_anchor  # the block's first token drafts too
        self.n_max = block_size if self.anchor else block_size - 1
        head.export_nextn(True, masked=True)
        head.causal(False)

    def begin(self, prompt: Sequence[int]) -> Reads:
        m = self.model
        self._take()
        m.rewind(_shared(m.tokens, prompt[:-1]))
        return Reads(layers=self.layers, redo=len(m.tokens))

    def _write(self, batch: Decoded, n: int) -> None:
        """The first n rows' features into the cache at their positions."""
        m = self.model
        m.rewind(batch.pos[0])
        for a in range(0, n, m.n_ubatch):  # a non-causal decode fits one ubatch
            b = min(a + m.n_ubatch, n)
            m.run([(None, batch.pos[i], batch.layers[i], False) for i in range(a, b)])
        m.tokens.extend(batch.tokens[:n])

    def _draft(self, context: Sequence[int], n_past: int, k: int, p_min: float,
               out: list[int]) -> None:
        """One decode of the block [last token, mask, ...] (its cells go after)."""
        m = self.model
        n_block = min(k, self.n_max) + (0 if self.anchor else 1)
        m.run([(context[-1] if i == 0 else self.mask, n_past + i, None, True)
               for i in range(n_block)])
        first = 0 if self.anchor else 1
        rows = m.logits_rows(n_block)[first:, : self.n_vocab]  # the block's rows, one read
        if self.dspark or p_min <= 0:
            # every row's top token in one argmax; DSpark stops at the first row whose
            # confidence is under p_min, before that row is read (as native)
            n = len(rows)
            if self.dspark and p_min > 0:
                conf = m.nextn_rows(n_block)[first:, 0]
                n = next((i for i, c in enumerate(conf) if c < p_min), n)
            out.extend(finite_argmaxes(rows[:n]))
            return
        for row in rows:  # DFlash's p_min: the top token's share of the top ten
            token, p = _top(row, p_min)
            if p < p_min:
                break
            out.append(token)
