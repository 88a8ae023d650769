"""The DraftSource protocol: a Protocol, not a class tree."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from specli.config import DraftPolicy, SamplingParams
from specli.verify import Dist

if TYPE_CHECKING:
    from specli.backend import Model
    from specli.rules import Rules


@dataclass
class Proposal:
    """Up to k drafted tokens; `q` holds the draft's distribution per token when it sampled them
    (a model draft at temperature > 0), None for a deterministic proposal (greedy or n-gram)."""

    tokens: list[int] = field(default_factory=list)
    q: list[Dist] | None = None
    source: str = ""  # the DraftSource.name that proposed it, for per-source statistics


class DraftSource(Protocol):
    """Anything that proposes tokens: a draft model, an n-gram table, a chain of them."""

    name: str
    own_length: bool  # drafts up to a length of its own (an n-gram type's m), not --draft
    model: Model | None  # the draft model it decodes with, if any (for timing)

    def begin(self, prompt: Sequence[int]) -> None:
        """A new generation starts from `prompt` (its last token is not yet verified)."""

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator, policy: DraftPolicy | None = None,
                rules: Rules | None = None) -> Proposal:
        """Propose up to k tokens to follow `context` (all committed tokens). policy: this
        step's (p_min for a draft model; a chain gives each source its own k from it).
        rules: the committed DRY and grammar state, if the request has them; a source may
        draft within them (on a fork); the engine cuts any proposal at its first token the
        grammar refuses."""

    def rewind(self, n_keep: int) -> None:
        """Forget any state past the first n_keep tokens of the context."""

    def observe(self, n_accepted: int) -> None:
        """How many of the last proposal's tokens the target accepted."""

    def end(self) -> None:
        """The generation is over (finished, failed or abandoned): flush what was learnt."""


def rules_kw(rules: Rules | None) -> dict:
    """The rules keyword, only when there are rules: a source written before them keeps
    working for requests without any."""
    return {} if rules is None else {"rules": rules}
