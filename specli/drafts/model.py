"""A second, smaller GGUF model with its own context as the draft (llama.cpp's draft-simple)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from specli.config import DraftPolicy, SamplingParams
from specli.drafts.base import DraftSource, Outcome, top_share
from specli.drafts.tree import Calibration, Tree, draft_tree
from specli.verify import (
    Dist,
    NoToken,
    finite_argmax,
    need_for,
    penalty_window,
    sampling_dist,
    transform,
)

if TYPE_CHECKING:
    from specli.backend import Backend
    from specli.rules import Rules

class ModelDraft(DraftSource):
    """Keeps its KV cache in step with the target's committed tokens without re-decoding any.

    After a step its cache holds the context up to the last accepted draft token; the tokens it
    lacks (the bonus token, plus the final drafted token after a full acceptance) are fed at the
    start of the next `propose`, in one batch.
    """

    name = "draft"
    trees = True  # policy.n_seq > 1: a tree in its model's sequences
    # a server's slot whose k the batch's plan chooses (0 under load): the prompt is fed
    # when the slot first drafts (catch_up), not at begin, where it is often never used
    lazy = False

    def __init__(self, model: Backend, *, n_vocab_target: int | None = None):
        self.model = model
        self.calib = Calibration()  # how often the target takes its top candidate
        # a draft vocabulary may be up to 128 tokens larger: never propose (or give q mass to)
        # ids the target does not have
        self.n_vocab = min(model.n_vocab, n_vocab_target or model.n_vocab)

    def begin(self, prompt: Sequence[int]) -> None:
        if len(prompt) > self.model.n_ctx:  # a smaller draft context (-cd): no drafts this time
            self.model.rewind(0)
            return
        if self.lazy:  # keep what the cache shares with the prompt, decode nothing yet
            m, n = self.model, 0
            while n < min(len(m.tokens), len(prompt) - 1) and m.tokens[n] == prompt[n]:
                n += 1
            m.rewind(n)
            return
        self.model.sync(prompt[:-1])

    def catch_up(self, context: Sequence[int]) -> bool:
        """Decode what the cache lacks of the context but its last token (the proposal's
        first decode), so that a proposal's time is its drafting's."""
        if self.behind(context):
            self.model.decode(context[len(self.model.tokens):-1], logits="none")
        return True

    def behind(self, context: Sequence[int]) -> int:
        m = self.model
        return max(0, len(context) - 1 - len(m.tokens)) if len(context) < m.n_ctx else 0

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator, policy: DraftPolicy | None = None,
                rules: Rules | None = None) -> Tree:
        """A sequence, or with policy.n_seq > 1 a tree of up to k nodes (drafts/tree.py)."""
        m = self.model
        p_min = policy.p_min if policy is not None else 0.0
        k = min(k, m.n_ctx - len(context))  # the draft's context may be smaller (-cd)
        if policy is not None and policy.n_seq > 1:
            if k <= 0:
                return Tree(source=self.name)
            return draft_tree(m, self.feed(context), self.n_vocab, context, k, sp, rng, policy,
                              self.calib, self.name)
        if k <= 0:
            return Tree()
        logits = self.feed(context)[0, : self.n_vocab]
        tokens: list[int] = []
        q: list[Dist] | None = None if sp.greedy else []
        g = rules.fork() if rules is not None else None
        try:
            self._draft(logits, tokens, q, context, k, sp, rng, p_min, g)
        except NoToken:  # the grammar allows nothing the draft knows: propose what it has
            pass
        finally:
            if g is not None:
                g.close()
        return Tree.chain(tokens, q, self.name)

    def feed(self, context: Sequence[int]) -> np.ndarray:
        """Bring the cache to the whole context (decoding only what it lacks, in one batch)
        and return the row that follows it."""
        m = self.model
        n_have = len(m.tokens)
        if n_have >= len(context):  # nothing new: re-decode the last token for its logits
            m.rewind(len(context) - 1)
            n_have = len(context) - 1
        new = context[n_have:]
        if m.offloaded and len(new) == 2:
            # on a GPU every draft decode stays one token long: ggml-cuda drops a context's
            # CUDA graph whenever the batch shape changes, and re-warms and re-captures it
            m.decode(new[:1])
            new = new[1:]
        return m.decode(new, logits="last")

    def _draft(self, logits: np.ndarray, tokens: list[int], qs: list[Dist] | None,
               context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator,
               p_min: float, g: Rules | None) -> None:
        """Up to k tokens into `tokens` (and their distributions into qs, sampling)."""
        m = self.model
        while True:
            # the target's transforms (logit bias, penalties, DRY, grammar) on the draft's row
            # too, so that q is the draft's distribution under the same rules
            if sp.transforms:  # (the history is built only when something reads it)
                logits = transform(logits, sp, [*penalty_window(context, sp), *tokens])
            if g is not None:
                logits = g.apply(logits, need_for(sp, logits.shape[0]))
            if sp.greedy:
                token = finite_argmax(logits)
                if p_min > 0.0 and top_share(logits, token) < p_min:
                    return
            else:
                q = sampling_dist(logits, sp)
                if q.probs[0] < p_min:
                    return
                token = q.sample(rng)
                qs.append(q)
            tokens.append(token)
            if g is not None and not m.is_eog(token):
                g.accept(token)
            if len(tokens) >= k or m.is_eog(token):
                return  # the last drafted token is not decoded: it may be rejected
            logits = m.decode([token], logits="last")[0, : self.n_vocab]

    # process: nothing (the next proposal feeds the draft what it lacks of the context)

    def accept(self, outcome: Outcome) -> None:
        """The cache keeps the committed tokens it holds; after a tree, the branch of the
        accepted path becomes the cache as far as the draft decoded it, every other branch
        is dropped."""
        m, tree, path = self.model, outcome.tree, outcome.path
        if tree is not None and tree.top:
            self.calib.record(tree, path, outcome.token)
        if tree is None or not tree.decoded:  # a sequence: decoded in the committed branch
            if m.n_branch > 1:
                m.keep(0, m.tokens[:outcome.n_keep])
            else:
                m.rewind(outcome.n_keep)
            return
        seq = min(tree.seqs[path[-1]]) if path else 0
        n = min(len(path), tree.decoded.get(seq, 0))
        m.keep(seq, [*m.tokens[:outcome.n_keep - len(path)], *(tree.tokens[i] for i in path[:n])])
