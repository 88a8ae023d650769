"""THE engine: speculative decoding over a target model (backend.Backend) and an optional
DraftSource, the loop only (plan.py assembles engines, prompt.py renders prompts).

Three layers, after mlx-lm: `steps()` yields raw (token, from_draft) events, `stream()` yields
text chunks with finish reasons, `complete()` returns the text and its Stats. Nothing here
prints; the CLI and the server format what the loop records in Stats.
"""

from __future__ import annotations

import codecs
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from specli import prompt as prompts
from specli.backend import Backend
from specli.config import DraftPolicy, SamplingParams, SpecRequest
from specli.drafts import DraftSource
from specli.drafts.base import Outcome, Reads, Sources
from specli.drafts.tree import Tree
from specli.errors import BackendError, ContextOverflowError, UsageError
from specli.meter import Meter, prompt_progress
from specli.rules import Rules
from specli.stats import Stats
from specli.toolcall import ChatOptions
from specli.verify import (
    NonFinite,
    NoToken,
    TokenProbs,
    TransformError,
    need_for,
    path_probs,
    penalty_window,
    transform,
    verify_tree,
)


@dataclass
class Chunk:
    """A piece of generated text; the last chunk of a stream carries finish_reason and stats."""

    text: str
    finish_reason: str | None = None
    stats: Stats | None = None
    token: int | None = None  # the token this chunk decodes (None on the last chunk)
    probs: TokenProbs | None = None  # its probabilities, when sp.n_probs asks for them


@dataclass
class Completion:
    text: str
    tokens: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)


class Engine:
    """The loop over a target model and a draft source (plan.py assembles both: load,
    load_slots). drafts: the sources for a request's own --spec-type list, when the plan
    gave them (a server slot's)."""

    def __init__(self, target: Backend, draft: DraftSource | None = None,
                 draft_params: DraftPolicy | None = None, *, drafts: Sources | None = None):
        self.target = target
        self.draft = draft
        self.draft_params = draft_params or DraftPolicy()
        self.drafts = drafts
        # llama.cpp's --context-shift and --keep: a full context drops the older half of
        # what follows the first n_keep tokens (-1: the whole prompt) and goes on
        self.context_shift = False
        self.n_keep = 0
        # a server slot's: the first token is the target's alone, as llama-server samples it
        # from the prompt's decode (the time to first token pays no draft catching up on the
        # prompt, no drafting, no longer verification); `run` drafts from the first step, as
        # llama-speculative-simple does
        self.first_plain = False

    @property
    def draft_model(self) -> Backend | None:
        """The draft model, whichever types the engine was loaded with."""
        return self.draft.model if self.draft is not None else None

    def forget(self) -> None:
        """Empty the caches: the next prompt is evaluated whole, nothing reused."""
        self.target.rewind(0)
        if self.draft_model is not None:
            self.draft_model.rewind(0)

    def close(self) -> None:
        if self.draft_model is not None:  # first: a head's context lives beside the target's
            self.draft_model.close()
        self.target.close()

    # -- prompts (prompt.py) ----------------------------------------------------------------
    def tokenize(self, text: str, chat: bool = False) -> list[int]:
        return self.prompt(text, chat)[0]

    def prompt(self, text: str, chat: bool = False) -> tuple[list[int], list[int] | None]:
        """A prompt's tokens, and a translating draft's own for it (None: it reads the
        target's; a plain text's, always)."""
        if chat:
            return self.chat_prompt([{"role": "user", "content": text}])[1:]
        return prompts.tokenize(self.target, text), None

    def tokenize_messages(self, messages: list[dict], continue_final: bool = False,
                          opts: ChatOptions | None = None) -> list[int]:
        return self.chat_prompt(messages, continue_final, opts)[1]

    def chat_prompt(self, messages: list[dict], continue_final: bool = False,
                    opts: ChatOptions | None = None
                    ) -> tuple[str, list[int], list[int] | None]:
        """Prompt text and tokens, and a translating draft's own tokens (the messages
        rendered through its own template; None for any other draft): the `draft_prompt`
        of steps, stream and complete."""
        text, ids = prompts.chat_prompt(self.target, messages, continue_final, opts)
        if self.draft_params.translate and self.draft_model is not None:
            return text, ids, prompts.draft_prompt(self.target, self.draft_model, messages,
                                                   continue_final)
        return text, ids, None

    def render_messages(self, messages: list[dict], continue_final=False, opts=None) -> str:
        return prompts.render_messages(self.target, messages, continue_final, opts)

    # -- layer 1: the loop ------------------------------------------------------------------
    def steps(self, prompt: Sequence[int], n_predict: int, sp: SamplingParams, stats: Stats,
              speculative: bool = True, spec: SpecRequest | None = None,
              probs: list[TokenProbs] | None = None,
              progress: Callable[[dict], None] | None = None,
              draft_prompt: Sequence[int] | None = None) -> Iterator[tuple[int, bool]]:
        """Yield (token, from_draft) for each emitted token; fills `stats` as it goes.

        n_predict < 0 means until an end-of-generation token or a full context. spec: this
        request's own draft types and lengths (the server's `speculative` object). probs:
        with sp.n_probs set, each token's TokenProbs is appended before the token is yielded.
        progress: called with llama-server's prompt_progress (total, cache, processed,
        time_ms) before and after each batch of the prompt. draft_prompt: a translating
        draft's own tokens for the prompt (chat_prompt's; None: it reads the prompt's text).
        """
        tgt, policy = self.target, self.draft_params.overlay(spec)
        draft = self._source(spec, draft_prompt) if speculative else None
        self._check(prompt, sp)
        rules = Rules.start(tgt, sp, prompt)  # a grammar is parsed before any work
        stats.seed = sp.seed if sp.seed is not None else secrets.randbits(32)
        rng = np.random.default_rng(stats.seed)
        stats.n_draft, stats.n_prompt = policy.n_draft if draft else 0, len(prompt)
        if draft is None or not self._tree(draft, policy, rules):
            policy = replace(policy, n_seq=1)  # this generation drafts one sequence a step
        stats.n_seq_dft = policy.n_seq
        if draft:
            stats.drafting_with(draft.names())
        # exact verification matches the target's own samples: a tree drafts its most
        # likely tokens (llama.cpp's draft sampler), a chain samples (_propose)
        dsp = replace(sp, temp=0.0) if policy.exact and policy.n_seq > 1 and not sp.greedy \
            else sp
        if draft:
            stats.spec_sampling = "greedy" if sp.greedy else policy.sampling
        meter = Meter(stats, tgt, draft.model if draft else None)
        reads = None
        try:
            with meter.prompt():
                if draft:
                    reads = draft.begin(prompt) or _NOTHING
                    reads.start(tgt)
                # the last prompt token opens the first verification batch
                tgt.sync(prompt[:-1],
                         prompt_progress(progress, len(prompt)) if progress else None,
                         span=len(prompt), each=self._teller(draft, reads),
                         outputs=bool(reads and reads.hidden))
            context = list(prompt)  # committed; context[-1] is not yet in the target cache
            n_left = n_predict if n_predict >= 0 else tgt.n_ctx
            stats.finish_reason = "length"
            with meter.decode():
                t0 = time.perf_counter()
                while n_left > 0:
                    if len(context) >= tgt.n_ctx and self.context_shift:
                        self._shift(context, len(prompt), draft, reads, policy, stats)
                    if len(context) > tgt.n_ctx:
                        stats.truncated = True  # llama-server's: the context ran out
                        break
                    # draft at most what the budget, the context and one batch can take
                    # (with context shift, a step ends at a full context at the latest, so
                    # that the shift comes where the target alone would make it: the same
                    # tokens dropped, the same text)
                    k = min(n_left - 1, tgt.n_ctx - len(context) - self.context_shift,
                            tgt.n_batch - 1,
                            tgt.n_ctx if policy.limit is None else policy.limit
                            ) if draft and (stats.n_first or not self.first_plain) else 0
                    tokens, n_drafted, eog = self._step(draft, policy, context, k, sp, rng,
                                                        stats, rules, probs, reads, dsp)
                    if not stats.n_first:  # llama-server's rates start after the first
                        stats.n_first = len(tokens)
                        stats.t_first_s = time.perf_counter() - t0
                    for i, t in enumerate(tokens):
                        context.append(t)
                        stats.n_predict += 1
                        n_left -= 1
                        yield t, i < n_drafted
                    if eog:
                        stats.finish_reason = "stop"
                        return
        finally:
            # a consumer that stopped inside the first step took fewer of its tokens
            stats.n_first = min(stats.n_first, stats.n_predict)
            if reads:
                reads.start(tgt, False)
            if draft:
                draft.end()
            if rules is not None:
                rules.close()

    def _shift(self, context: list[int], n_prompt: int, draft: DraftSource | None,
               reads: Reads | None, policy: DraftPolicy, stats: Stats) -> None:
        """llama-server's context shift, where the caches allow it: keep the first n_keep
        tokens (+1 for a BOS; at most n_ctx - 4), drop half of what follows them from the
        target's cache and the context, move the rest back; a draft begins again on the
        shifted context (a draft model's cache keeps the prefix they share). A head, which
        reads the target's states of every token, a tree's branches and a translating draft
        do not shift: the generation ends at a full context, as without --context-shift."""
        tgt = self.target
        if draft is not None and (policy.n_seq > 1 or policy.translate or (
                reads is not None and (reads.hidden or reads.layers or reads.nextn))):
            return
        n_keep = n_prompt if self.n_keep < 0 else self.n_keep
        bos = tgt.tokenize("", add_special=True)  # what the tokenizer puts first, if any
        n_keep += int(bool(bos) and context[:1] == bos[:1])
        n_keep = min(tgt.n_ctx - 4, n_keep)
        n_left = len(context) - 1 - n_keep  # the cache holds all of the context but its last
        n_discard = min(n_left // 2, max(0, n_left - 1))
        if n_discard <= 0 or not tgt.shift(n_keep, n_discard):
            return
        del context[n_keep:n_keep + n_discard]
        stats.truncated = True
        stats.n_shifts += 1
        if draft is not None:
            draft.end()
            draft.begin(context)

    def _step(self, draft: DraftSource | None, policy: DraftPolicy, context: list[int], k: int,
              sp: SamplingParams, rng: np.random.Generator, stats: Stats,
              rules: Rules | None = None, probs: list[TokenProbs] | None = None,
              reads: Reads | None = None,
              dsp: SamplingParams | None = None) -> tuple[list[int], int, bool]:
        """One speculative step: (tokens to emit, how many of them the draft proposed, whether
        the target ended the generation). A drafted sequence is a tree of one branch. Whatever
        happens, both caches end at a committed length: the accepted path on success, the
        previous one on an exception (a failed decode, a closed stream). dsp: the draft's
        sampling settings (sp's unless policy.exact makes a tree's greedy)."""
        tree, path, token = _EMPTY, [], None
        timed, t0 = draft.timer() if draft else None, 0.0
        try:
            # 1. propose (empty: the target decodes its next token alone)
            tree = self._propose(draft, policy, context, k, dsp or sp, rng, rules)
            t0 = time.perf_counter()
            # 2. verify: one target decode of [last token, *nodes], a logits row each
            rows = self._verify_batch(context, tree, draft, reads)
            row = _rows(rows, sp, context, tree, rules)
            path, token = verify_tree(tree, row, sp, rng, policy.exact)
            # 3. accept: the rules move past the target's token; an accepted
            # end-of-generation token ends the step as the target's
            if rules is not None and not self.target.is_eog(token):
                rules.accept(token)
            path, token = _cut_at_eog(tree, path, token, self.target.is_eog)
            if probs is not None and sp.n_probs is not None:
                probs.extend(path_probs(rows, row, tree, path, token, sp, self.target.is_eog))
        except (NonFinite, NoToken, TransformError) as e:
            raise _error(e, tree, stats.n_predict) from None
        finally:
            # 4. rewind both caches to the committed tokens; the draft learns how it went
            self._rewind(draft, context, tree, path, token)
            if timed is not None and token is not None:  # the verification's time, from
                # the proposal to the rewound caches (a plain step's too: --draft auto)
                timed(len(tree) + 1, time.perf_counter() - t0)
        if len(tree):
            stats.record_step(len(tree), len(path), tree.source, depth=tree.max_depth,
                              branches=tree.n_branches)
        else:
            stats.n_plain += 1
        eog = self.target.is_eog(token)
        drafted = [tree.tokens[i] for i in path]
        return drafted + ([] if eog else [token]), len(drafted), eog

    def _propose(self, draft: DraftSource | None, policy: DraftPolicy, context: list[int],
                 k: int, sp: SamplingParams, rng: np.random.Generator,
                 rules: Rules | None) -> Tree:
        """The draft's proposal as a tree, cut before its first token the grammar refuses.
        A proposal shorter than --draft-min is not worth a verification; a sampled one is
        verified whatever its length (its length depends on what it drew: dropping the
        short ones would bias what is accepted)."""
        n_min = max(policy.n_min, 1)
        if not draft or k < n_min:
            return _EMPTY
        if policy.exact and not sp.greedy:
            # the draft draws with the uniforms the target will draw at the same positions
            # (a copy of the generator): where q is close to p, it proposes the very token
            # the target's sample will be, and the request's stream is left untouched
            rng = _peek(rng)
        tree = draft.propose(context, policy.k_for(draft.own_length, k), sp, rng, policy, rules)
        if rules is not None:  # a chain (trees are drafted without rules)
            tree = tree.prefix(rules.allowed_prefix(tree.tokens))
        return tree if len(tree) >= n_min or tree.q else _EMPTY

    def _verify_batch(self, context: list[int], tree: Tree, draft: DraftSource | None,
                      reads: Reads | None) -> np.ndarray:
        """The target's rows for the last committed token and every node, each in the
        branches through it; the draft is told what was decoded (process)."""
        tgt, n_past = self.target, len(context) - 1
        tokens = [context[-1], *tree.tokens]
        if tree.branched:
            tgt.branch(tree.seq_ids)
            pos = [n_past, *(n_past + d for d in tree.depth)]
            seqs = [tree.seq_ids, *tree.seqs]
            rows = tgt.decode_tree(tokens, pos, seqs)
        else:
            rows = tgt.decode(tokens, logits="all")
            pos, seqs = range(n_past, n_past + len(tokens)), None
        if draft:
            draft.process((reads or _NOTHING).decoded(tgt, tokens, pos, seqs))
        return rows

    def _rewind(self, draft: DraftSource | None, context: list[int], tree: Tree,
                path: list[int], token: int | None) -> None:
        """Both caches back to the committed tokens: the context and the accepted path after
        a step that ended (token set), the context without its last token after one that
        failed. The accepted path's branch becomes the committed one."""
        tgt = self.target
        done = token is not None
        n_keep = len(context) + len(path) if done else len(context) - 1
        if tree.branched:
            seq = min(tree.seqs[path[-1]]) if done and path else 0
            tgt.keep(seq, [*context, *(tree.tokens[i] for i in path)] if done
                     else context[:-1])
        else:
            tgt.rewind(n_keep)
        if draft:
            draft.accept(Outcome(n_keep, tree, path, token) if done and len(tree)
                         else Outcome(n_keep))

    def _teller(self, draft: DraftSource | None,
                reads: Reads | None) -> Callable[[Sequence[int], int], None] | None:
        """What tells the draft of each batch of the prompt the target decodes."""
        if not draft:
            return None
        reads = reads or _NOTHING

        def told(tokens: Sequence[int], pos0: int) -> None:
            draft.process(reads.decoded(self.target, tokens, range(pos0, pos0 + len(tokens))))

        return told

    def _tree(self, draft: DraftSource | None, policy: DraftPolicy,
              rules: Rules | None) -> bool:
        """Whether this generation drafts trees: more than one draft sequence, a draft model
        alone (not chained with n-gram types), no grammar or DRY (their state follows one
        path)."""
        return (policy.n_seq > 1 and rules is None and draft is not None and draft.trees
                and min(self.target.n_branch, draft.model.n_branch) >= policy.n_seq)

    def _source(self, spec: SpecRequest | None,
                draft_prompt: Sequence[int] | None) -> DraftSource | None:
        """The request's own draft types' source, else the engine's."""
        if self.drafts is None:
            if spec is not None and spec.types is not None:
                raise UsageError("this engine drafts with its own source only")
            return self.draft
        self.drafts.expect(draft_prompt)
        return self.drafts(spec)

    def _check(self, prompt: Sequence[int], sp: SamplingParams) -> None:
        check_bias((t for t, _ in sp.logit_bias), self.target.n_vocab)
        if not prompt:
            raise UsageError("empty prompt", hint="give -p TEXT or -f FILE with some text")
        if len(prompt) >= self.target.n_ctx:
            raise ContextOverflowError(
                f"prompt is {len(prompt)} tokens, the context holds {self.target.n_ctx}",
                hint="raise -c/--ctx-size or shorten the prompt",
                n_prompt_tokens=len(prompt), n_ctx=self.target.n_ctx)

    # -- layer 2: text ----------------------------------------------------------------------
    def stream(self, prompt: Sequence[int], n_predict: int, sp: SamplingParams,
               speculative: bool = True, spec: SpecRequest | None = None,
               stats: Stats | None = None,
               progress: Callable[[dict], None] | None = None,
               draft_prompt: Sequence[int] | None = None) -> Iterator[Chunk]:
        """Text as it is decoded (UTF-8 split across tokens is held back); the last chunk has
        the finish reason and the stats. Closing the stream early closes the loop at once
        (caches rewound, `stats` complete)."""
        stats = stats if stats is not None else Stats()
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        probs: deque[TokenProbs] | None = deque() if sp.n_probs is not None else None
        steps = self.steps(prompt, n_predict, sp, stats, speculative, spec, probs, progress,
                           draft_prompt)
        try:
            for token, _ in steps:  # a chunk per token, "" while UTF-8 is held back
                yield Chunk(utf8.decode(self.target.token_bytes(token)), token=token,
                            probs=probs.popleft() if probs else None)
            yield Chunk(utf8.decode(b"", final=True), stats.finish_reason, stats)
        finally:
            steps.close()

    # -- layer 3: the whole answer ----------------------------------------------------------
    def complete(self, prompt: Sequence[int], n_predict: int, sp: SamplingParams,
                 speculative: bool = True, spec: SpecRequest | None = None,
                 draft_prompt: Sequence[int] | None = None) -> Completion:
        stats = Stats()
        tokens = [t for t, _ in self.steps(prompt, n_predict, sp, stats, speculative, spec,
                                           draft_prompt=draft_prompt)]
        text = b"".join(self.target.token_bytes(t) for t in tokens).decode("utf-8", "replace")
        return Completion(text, tokens, stats)


def check_bias(tokens: Iterable[int], n_vocab: int) -> None:
    """UsageError naming the first biased token outside the vocabulary (0..n_vocab - 1)."""
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise UsageError(f"logit bias for token {bad}, outside the vocabulary "
                         f"(0..{n_vocab - 1})")


def _rows(rows: np.ndarray, sp: SamplingParams, context: list[int], tree: Tree,
          rules: Rules | None = None) -> Callable[[int, list[int]], np.ndarray]:
    """Row r of a verification batch as the sampler sees it: transformed with the history it
    follows (the context, then the nodes of `path` above it), then through the rules (DRY,
    the grammar's mask) once they have followed that path. verify_tree descends one path,
    asking for a row only once the node above it is accepted; the rules follow the path as
    it grows, and a row asked for off it is an error, not a wrong mask."""
    if not sp.transforms and rules is None:
        return lambda r, path: rows[r]
    tail = penalty_window(context, sp)  # (a view: [*tail, *above] copies what it needs)
    need = need_for(sp, rows.shape[1])
    followed: list[int] = []  # the path's tokens the rules have moved past
    done: dict[int, np.ndarray] = {}  # a row asked for again is the same row

    def follow(above: list[int]) -> None:
        """The rules moved past the path's tokens they have not yet seen."""
        if above[:len(followed)] != followed:
            raise RuntimeError("a verification row asked for off the path the rules follow")
        for t in above[len(followed):]:
            rules.accept(t)
            followed.append(t)

    def row(r: int, path: list[int]) -> np.ndarray:
        if r in done:
            return done[r]
        above = [tree.tokens[i] for i in path]
        x = transform(rows[r], sp, [*tail, *above])
        if rules is not None:
            follow(above)
            x = rules.apply(x, need)
        done[r] = x
        return x

    return row


def _peek(rng: np.random.Generator) -> np.random.Generator:
    """A generator that draws what `rng` will draw next, leaving `rng` where it is."""
    twin = np.random.Generator(type(rng.bit_generator)(0))  # (0: no entropy to gather)
    twin.bit_generator.state = rng.bit_generator.state
    return twin


_EMPTY = Tree()  # no nodes: the target decodes the last token alone
_NOTHING = Reads()  # a draft that reads nothing of the target's decodes


def _cut_at_eog(tree: Tree, path: list[int], token: int,
                is_eog: Callable[[int], bool]) -> tuple[list[int], int]:
    """The accepted path up to its first end-of-generation token, which becomes the
    target's token (it ends the generation)."""
    cut = next((j for j, i in enumerate(path) if is_eog(tree.tokens[i])), None)
    return (path, token) if cut is None else (path[:cut], tree.tokens[path[cut]])


def _error(e: Exception, tree: Tree, n_predict: int) -> Exception:
    """A failed step's error as the user reads it, naming the token it was choosing."""
    if isinstance(e, TransformError):
        return UsageError(str(e), hint="use a repeat_penalty near 1 and penalties and biases "
                          "of ordinary size")
    if isinstance(e, NoToken):
        return UsageError(f"the grammar allows no token after {n_predict} generated tokens",
                          hint="check that the grammar can be completed")
    # a row of NaN or inf (NonFinite): no token can be chosen from it
    who = "the draft model" if e.row < 0 else "the model"
    depth = tree.depth[e.row - 1] if e.row > 0 else 0
    return BackendError(f"{who} produced NaN or infinite logits at token "
                        f"{n_predict + depth + 1}", hint="its weights may be damaged: try "
                        "another file or quantization")
