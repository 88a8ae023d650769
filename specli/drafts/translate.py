"""A draft model with another tokenizer (--spec-type draft-translate), after Hugging Face's
universal assisted generation: the draft runs in its own vocabulary over the same text; its
proposal is turned into text and the text into the target's tokens, aligned on the text
already committed; the target verifies those as usual. A proposal is deterministic (q
one-hot, as an n-gram's), so sampling keeps the target's distribution."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from specli.config import DraftPolicy, SamplingParams
from specli.drafts.base import DraftSource
from specli.drafts.tree import Tree
from specli.verify import finite_argmax

if TYPE_CHECKING:
    from specli.backend import Model
    from specli.rules import Rules

_ALIGN = 4  # committed target tokens re-tokenized with a proposal, to find where it starts


def _boundary(data: bytes | bytearray, i: int) -> bool:
    """Whether byte offset i starts a UTF-8 character (or ends the data)."""
    return i >= len(data) or (data[i] & 0xC0) != 0x80


def _complete(data: bytes) -> int:
    """The length of data's longest prefix that ends on a whole UTF-8 character."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 == 0x80:
            continue  # a continuation byte: look further back for its lead
        need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4
        return n if back >= need else n - back
    return n


def _spell(model: Model, ids: Sequence[int]) -> bytes:
    return b"".join(model.token_bytes(t) for t in ids)


def _tokenize_piece(model: Model, data: bytes) -> list[int] | None:
    """data's tokens as they come in the middle of a text. A tokenizer that puts a space
    before any text it tokenizes alone (SentencePiece's add_space_prefix: Llama 2, Mistral)
    is given a newline to put it on, and the tokens spelling it are dropped. None when
    neither spells data exactly."""
    ids = model.tokenize_bytes(data)
    if _spell(model, ids) == data:
        return ids
    ids = model.tokenize_bytes(b"\n" + data)
    spelled = b""
    for j, t in enumerate(ids[:4]):
        spelled += model.token_bytes(t)
        if spelled.endswith(b"\n") and _spell(model, ids[j + 1:]) == data:
            return ids[j + 1:]
    return None


class TranslateDraft(DraftSource):
    """The draft's cache holds its own tokenization of the prompt and of the committed text;
    before each proposal its tokens that still spell a prefix of the committed text are kept
    (those past the first difference dropped) and the rest of the text is tokenized and fed.
    draft_prompt: the draft's own tokens for the next prompt (a chat rendered through its
    own template, prompt.draft_prompt), used by the next begin; else it reads the prompt's
    text."""

    name = "draft-translate"  # --draft caps it (in target tokens)

    def __init__(self, model: Model, target: Model):
        self.model, self.target = model, target
        self.draft_prompt: list[int] | None = None
        self._prompt: list[int] = []  # the draft's prompt
        self._n_prompt = 0  # the target's prompt length
        self._text = bytearray()  # the generated text committed so far
        self._n_text = 0  # generated target tokens spelled in _text
        self._spelled: list[bytes] = []  # the bytes of each generated draft token cached

    # -- the protocol -----------------------------------------------------------------------
    def begin(self, prompt: Sequence[int]) -> None:
        draft_prompt, self.draft_prompt = self.draft_prompt, None
        if draft_prompt is None:  # the prompt's text, the target's control tokens left out
            text = b"".join(self.target.token_bytes(t) for t in prompt)
            draft_prompt = self.model.tokenize_bytes(text, add_special=True,
                                                     parse_special=False)
        self._prompt, self._n_prompt = list(draft_prompt), len(prompt)
        self._text.clear()
        self._n_text = 0
        self._spelled.clear()
        m = self.model
        if not self._prompt or len(self._prompt) >= m.n_ctx:
            m.rewind(0)
            self._prompt = []
            return
        m.sync(self._prompt[:-1])

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator, policy: DraftPolicy | None = None,
                rules: Rules | None = None) -> Tree:
        if not self._prompt or k <= 0:
            return Tree()
        tgt, m = self.target, self.model
        gen = context[self._n_prompt:]
        for t in gen[self._n_text:]:
            self._text += tgt.token_bytes(t)
        self._n_text = len(gen)
        text = bytes(self._text)
        row = self._sync(text)
        if row is None:
            return Tree()
        before = b"".join(self._spelled)  # what the draft's cache spells: text, or near it
        # draft up to k tokens in the draft's vocabulary, greedily (the proposal is one-hot)
        n = min(k, m.n_ctx - len(m.tokens) - 1)
        drafted, eog = [], False
        while len(drafted) < n:
            token = finite_argmax(row[: m.n_vocab])
            if m.is_eog(token):
                eog = True
                break
            drafted.append(token)
            if len(drafted) < n:  # the last drafted token is not decoded: it may be rejected
                row = m.decode([token], logits="last")[0]
                self._spelled.append(m.token_bytes(token))
        full = before + b"".join(m.token_bytes(t) for t in drafted)
        return Tree.chain(self._to_target(gen, text, full, eog)[:k], source=self.name)

    # accept: nothing (the next proposal keeps what still spells the committed text)

    # -- the draft's cache ----------------------------------------------------------------
    def _sync(self, text: bytes) -> np.ndarray | None:
        """Make the draft's cache its prompt plus its tokenization of `text` (as far as
        whole characters go), reusing the cached tokens that still spell a prefix of it;
        return the row that follows. None when it would not fit the draft's context."""
        m = self.model
        n_gen = max(0, len(m.tokens) - len(self._prompt))
        del self._spelled[n_gen:]
        keep, at = 0, 0
        for i, piece in enumerate(self._spelled):
            end = at + len(piece)
            if text[at:end] != piece:
                break
            at = end
            if _boundary(text, at):
                keep, kept_at = i + 1, at
        if keep == 0:
            kept_at = 0
        del self._spelled[keep:]
        rest = text[kept_at:_complete(text)] if _complete(text) > kept_at else b""
        new = (_tokenize_piece(m, rest) or m.tokenize_bytes(rest)) if rest else []
        want = [*self._prompt, *m.tokens[len(self._prompt):len(self._prompt) + keep], *new]
        if len(want) >= m.n_ctx:
            return None
        self._spelled += [m.token_bytes(t) for t in new]
        n_have = min(len(m.tokens), len(self._prompt) + keep)
        if n_have >= len(want):  # nothing new: re-decode the last token for its logits
            n_have = len(want) - 1
        m.rewind(n_have)
        return m.decode(want[n_have:], logits="last")[0]

    # -- from the draft's text to the target's tokens ---------------------------------------
    def _to_target(self, gen: Sequence[int], text: bytes, full: bytes,
                   eog: bool) -> list[int]:
        """The target's tokens for what the draft wrote past the committed text: the draft's
        text (`full`: its cached tokens then its drafted ones) must start with all of `text`;
        the new part, up to its last whole character, is tokenized together with the last
        committed target tokens, and the tokens after those are the proposal, if the
        committed ones came out unchanged. An end of generation the draft drafted right after
        is the target's end-of-sequence token."""
        tgt = self.target
        if not full.startswith(text):
            return []
        new = full[len(text):]
        new = new[:_complete(new)]
        out: list[int] = []
        if new:
            for m in range(min(_ALIGN, len(gen)), -1, -1):
                head = b"".join(tgt.token_bytes(t) for t in gen[len(gen) - m:])
                if not _boundary(head, 0):
                    continue
                ids = _tokenize_piece(tgt, head + new)
                if ids is not None and ids[:m] == list(gen[len(gen) - m:]):
                    out = ids[m:]
                    break
            else:
                return []
        if eog and full[len(text):] == new:  # the draft ends here: so may the target
            eos = tgt.eos_token
            if eos is not None:
                out.append(eos)
        return out
