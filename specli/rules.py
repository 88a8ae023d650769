"""The stateful part of the sampler chain: DRY and a grammar, whose state moves with every
accepted token. Row transforms that depend only on the history (logit bias, penalties) are
pure functions in verify.py; these hold llama.cpp samplers (backend.Dry, backend.Grammar)
and are forked wherever a draft or a verification walks ahead of what is committed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from specli.verify import grammar_mask


class _State(Protocol):
    def fork(self) -> _State: ...
    def accept(self, token: int) -> None: ...
    def close(self) -> None: ...


class Rules:
    """A generation's DRY and grammar state, in llama.cpp's chain order: DRY changes the
    row after the penalties, the grammar masks it before top-k (need: how many allowed
    tokens the chain can keep)."""

    def __init__(self, dry=None, grammar=None):
        self.dry, self.grammar = dry, grammar

    @classmethod
    def start(cls, model, sp, prompt: Sequence[int]) -> Rules | None:
        """The request's rules over the target's vocabulary, DRY having seen the prompt (as
        llama-server feeds it to the sampler); None when the request has neither."""
        dry = grammar = None
        try:
            if sp.dry_multiplier > 0 and sp.dry_penalty_last_n != 0:
                dry = model.dry(sp)
                tail = prompt if sp.dry_penalty_last_n < 0 else prompt[-sp.dry_penalty_last_n:]
                for t in tail:
                    dry.accept(t)
            if sp.grammar:
                grammar = model.grammar(sp.grammar)
        except BaseException:
            if dry is not None:
                dry.close()
            raise
        return cls(dry, grammar) if dry is not None or grammar is not None else None

    def fork(self) -> Rules:
        return Rules(self.dry.fork() if self.dry is not None else None,
                     self.grammar.fork() if self.grammar is not None else None)

    def apply(self, row: np.ndarray, need: int) -> np.ndarray:
        if self.dry is not None:
            row = self.dry.apply(row)
        if self.grammar is not None:
            row = grammar_mask(row, self.grammar.allowed, need)
        return row

    def allows(self, token: int) -> bool:
        return self.grammar is None or bool(self.grammar.allowed(np.array([token]))[0])

    def allowed_prefix(self, tokens: Sequence[int]) -> int | None:
        """How many of `tokens` the grammar allows in a row (checked on a fork); None when
        it allows them all."""
        if self.grammar is None or not tokens:
            return None
        g = self.fork()
        try:
            for n, t in enumerate(tokens):
                if not g.allows(t):
                    return n
                g.accept(t)
        finally:
            g.close()
        return None

    def accept(self, token: int) -> None:
        for s in (self.dry, self.grammar):
            if s is not None:
                s.accept(token)

    def close(self) -> None:
        for s in (self.dry, self.grammar):
            if s is not None:
                s.close()
