"""The DraftSource contract (llama.cpp's common_speculative shape: begin / propose /
process / accept / end), its no-op hooks in one place, and what flows through it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from specli.config import DraftPolicy, SamplingParams, SpecRequest
from specli.drafts.tree import Tree

if TYPE_CHECKING:
    from specli.backend import Backend
    from specli.rules import Rules

DRAFT_TOP_K = 10  # llama.cpp's draft sampler keeps the top 10 candidates


def top_share(logits: np.ndarray, token: int) -> float:
    """token's probability among the row's top ten (llama.cpp's p, for --draft-p-min)."""
    top = logits[np.argpartition(logits, -DRAFT_TOP_K)[-DRAFT_TOP_K:]]
    return float(1.0 / np.exp(top - logits[token]).sum())


@dataclass(frozen=True)
class Reads:
    """What a draft reads from the target's decodes, asked for once per generation (begin):
    hidden, the target's last hidden state of every token it decodes; layers, the input of
    these target layers for every token (an EAGLE-3 or DFlash head's features); nextn, the
    state the target's multi-token-prediction layers take, for every token (draft-mtp)."""

    hidden: bool = False
    layers: tuple[int, ...] = ()
    nextn: bool = False
    redo: int | None = None  # the target decodes the prompt from this position on, at most

    def __or__(self, other: Reads | None) -> Reads:
        if other is None:
            return self
        redo = [r for r in (self.redo, other.redo) if r is not None]
        return Reads(self.hidden or other.hidden, tuple(dict.fromkeys(
            (*self.layers, *other.layers))), self.nextn or other.nextn,
            min(redo) if redo else None)

    def start(self, target: Backend, on: bool = True) -> None:
        """The target's decodes keep (on) or stop keeping what is read; on, the target's
        cache keeps no more of the prompt than `redo` (what the draft has not seen of it is
        decoded again)."""
        if on and self.redo is not None:
            target.rewind(self.redo)
        if self.hidden:
            target.set_hidden(on)
        if self.layers or self.nextn:
            target.export(self.layers, self.nextn, on)

    def decoded(self, target: Backend, tokens: Sequence[int], pos: Sequence[int],
                seqs: Sequence[Sequence[int]] | None = None) -> Decoded:
        """What the target just decoded, with what is read of it."""
        n = len(tokens)
        return Decoded(tokens, pos, seqs, target.hidden(n) if self.hidden else None,
                       target.layer_rows(self.layers, n) if self.layers else None,
                       target.nextn_rows(n) if self.nextn else None)


@dataclass(frozen=True)
class Decoded:
    """One target decode, as the draft is told it after it ran (llama.cpp's process(batch)):
    tokens at positions pos (a tree's nodes in the branches seqs[i]; None: the committed
    sequence), and what the draft reads of it (Reads), when it asked for it: hidden, a
    (tokens, n_embd) view valid until the target's next decode; layers and nextn, copies."""

    tokens: Sequence[int]
    pos: Sequence[int]
    seqs: Sequence[Sequence[int]] | None = None
    hidden: np.ndarray | None = None
    layers: np.ndarray | None = None  # (tokens, len(Reads.layers) * n_embd), when asked for
    nextn: np.ndarray | None = None  # (tokens, n_embd), when asked for


@dataclass(frozen=True)
class Outcome:
    """How a step ended, as the draft is told it (llama.cpp's accept(n)): the target's cache
    now holds n_keep committed tokens. tree: the proposal the target verified when it was
    this source's (a chain is a tree of one branch), path its accepted nodes, token the
    target's own token after them. tree None: nothing of this source's was verified (another
    source proposed, the proposal was dropped, or the step failed): only forget what lies
    past n_keep."""

    n_keep: int
    tree: Tree | None = None
    path: Sequence[int] = ()
    token: int | None = None

    @property
    def n_accepted(self) -> int:
        return len(self.path)

    def elsewhere(self) -> Outcome:
        """The same end, for a source whose proposal was not the one verified."""
        return Outcome(self.n_keep)


class DraftSource:
    """Anything that proposes tokens (llama.cpp's common_speculative: begin / propose /
    process / accept / end): a draft model, an n-gram table, a chain of them. A source
    subclasses it, declares what it can do (own_length, model, trees) and overrides the
    hooks it needs; the others are the no-ops here."""

    name: str = ""
    own_length: bool = False  # drafts up to a length of its own (an n-gram type's m), not --draft
    model: Backend | None = None  # the draft model it decodes with, if any (for timing)
    trees: bool = False  # drafts trees (policy.n_seq > 1) in its model's sequences

    def names(self) -> tuple[str, ...]:
        """The sources it drafts with, by name (llama.cpp's "statistics <type>:" lines)."""
        return (self.name,)

    def begin(self, prompt: Sequence[int]) -> Reads | None:
        """A new generation starts from `prompt` (its last token is not yet verified).
        Returns what it reads from the target's decodes (None: nothing)."""
        return None

    def catch_up(self, context: Sequence[int]) -> bool:
        """Decode what it lacks of the context before a proposal is timed; False: a source
        that has nothing to decode, or decodes it inside its proposal."""
        return False

    def behind(self, context: Sequence[int]) -> int:
        """How many of the context's tokens catch_up would decode now (a draft model's
        cache that missed plain steps, or a server slot's prompt not yet fed)."""
        return 0

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator, policy: DraftPolicy | None = None,
                rules: Rules | None = None) -> Tree:
        """Propose up to k tokens to follow `context` (all committed tokens): a chain
        (Tree.chain: one sequence; empty: nothing), or a tree of up to k nodes when
        policy.n_seq > 1 and the source drafts trees. policy: this step's (p_min for a
        draft model; a chain gives each source its own k from it). rules: the committed DRY
        and grammar state, if the request has them; a source may draft within them (on a
        fork); the engine cuts any proposal at its first token the grammar refuses."""
        raise NotImplementedError

    def process(self, batch: Decoded) -> None:
        """What the target just decoded (the prompt's batches, then each verification)."""

    def accept(self, outcome: Outcome) -> None:
        """The step is over, whatever happened: keep what the target kept, learn from it."""

    def end(self) -> None:
        """The generation is over (finished, failed or abandoned): flush what was learnt."""

    def timer(self) -> Callable[[int, float], None] | None:
        """What the engine tells each step's verification of n tokens and its seconds, plain
        steps included (--draft auto's cost model, when no shared context times the target's
        decodes: `run`); None: nothing."""
        return None


class Sources(Protocol):
    """The sources an engine drafts with for each --spec-type list (plan.Drafts)."""

    def __call__(self, spec: SpecRequest | None = None) -> DraftSource | None:
        """The source for a request's own types (None: the engine's)."""

    def expect(self, draft_prompt: Sequence[int] | None) -> None:
        """The draft's own tokens for the next prompt, for a source that translates."""
