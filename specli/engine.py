"""THE engine: speculative decoding over a target Model and an optional DraftSource.

Three layers, after mlx-lm: `steps()` yields raw (token, from_draft) events, `stream()` yields
text chunks with finish reasons, `complete()` returns the text and its Stats. Nothing here
prints; the CLI and the server format what the loop records in Stats.
"""

from __future__ import annotations

import codecs
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np

from specli import loadable, pairing
from specli.backend import (
    Model,
    apply_builtin_template,
    builtin_templates,
    check_placement,
    knows_template,
)
from specli.batching import Gate, SharedContext
from specli.config import (
    MAX_DRAFT_SEQ,
    SPEC_TYPES,
    DraftPolicy,
    ModelParams,
    NgramParams,
    SamplingParams,
    SpecRequest,
)
from specli.drafts import (
    Adaptive,
    Chain,
    DraftSource,
    ModelDraft,
    NgramCache,
    NgramMap,
    NgramMod,
    NgramSimple,
    Proposal,
    VerifyCost,
)
from specli.drafts.base import Decoded, Outcome, Reads, rules_kw
from specli.drafts.translate import TranslateDraft
from specli.drafts.tree import Tree
from specli.errors import BackendError, ContextOverflowError, UsageError
from specli.rules import Rules
from specli.stats import ModelPerf, Stats
from specli.verify import (
    NonFinite,
    NoToken,
    TokenProbs,
    TransformError,
    need_for,
    sampled_probs,
    sampling_dist,
    token_probs,
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
    def __init__(self, target: Model, draft: DraftSource | None = None,
                 draft_params: DraftPolicy | None = None, ngram: NgramParams | None = None):
        self.target = target
        self.draft = draft
        self.draft_params = draft_params or DraftPolicy()
        self.ngram = ngram or NgramParams()
        self._sources: dict[tuple[str, ...], DraftSource | None] = {}  # per-request types
        self._draft_prompts: dict[tuple[int, ...], list[int]] = {}  # draft-translate's

    @classmethod
    def load(cls, target: ModelParams, draft: ModelParams | None = None,
             draft_params: DraftPolicy | None = None, spec_types: Sequence[str] = (),
             ngram: NgramParams | None = None) -> Engine:
        """Check the pair from GGUF metadata first (refuse before loading weights), then load.

        spec_types: llama.cpp's --spec-type names; n-gram types take precedence over the draft
        model, which is used whenever `draft` is given."""
        draft_params = draft_params or DraftPolicy()
        ngram = ngram or NgramParams()
        n_vocab = check_files(target, draft, spec_types, draft_params.translate)
        tree = check_tree(draft_params, draft, spec_types)
        t = Model(target, n_seq_max=draft_params.n_seq, tree=True) if tree else Model(target)
        try:
            dm = (None if draft is None else
                  Model(draft, n_seq_max=draft_params.n_seq, tree=True) if tree else Model(draft))
        except BaseException:
            t.close()
            raise
        try:
            return cls._assemble(t, dm, draft_params, spec_types, ngram, n_vocab)
        except BaseException:
            t.close()
            if dm is not None:
                dm.close()
            raise

    @classmethod
    def load_slots(cls, n: int, target: ModelParams, draft: ModelParams | None = None,
                   draft_params: DraftPolicy | None = None, spec_types: Sequence[str] = (),
                   ngram: NgramParams | None = None) -> tuple[list[Engine], list[SharedContext]]:
        """n engines (server slots) over one target context and one draft context, a sequence
        each, whose simultaneous decodes are batched together; n_ctx is per slot. Returns the
        engines and the shared contexts, which the caller closes. A generation on a slot runs
        between `shared[0].gate.enter()` and `.leave()`, so that decodes wait for it."""
        draft_params = draft_params or DraftPolicy()
        ngram = ngram or NgramParams()
        n_vocab = check_files(target, draft, spec_types, draft_params.translate)
        width = draft_params.n_seq if check_tree(draft_params, draft, spec_types) else 1
        if n * width > MAX_SEQUENCES:
            raise UsageError(f"{n} slots of {width} draft sequences are {n * width} sequences; "
                             f"llama.cpp holds at most {MAX_SEQUENCES}",
                             hint="fewer -np slots or a smaller --draft-n-seq")
        # a tree adds at most k + 1 nodes to the target's cells, (k - 1) a branch to the draft's
        cells = width * (draft_params.n_max + 1) if width > 1 else 0
        gate = Gate()
        shared = [SharedContext(target, n, gate, width=width, tree_cells=cells)]
        try:
            if draft is not None:
                shared.append(SharedContext(draft, n, gate, first=True, width=width,
                                            tree_cells=cells))
            prompts: dict = {}  # a translating draft's prompts: tokenized on any slot
            engines = [cls._assemble(shared[0].view(i), shared[1].view(i) if draft else None,
                                     draft_params, spec_types, ngram, n_vocab, prompts)
                       for i in range(n)]
        except BaseException:
            for c in shared:
                c.close()
            raise
        return engines, shared

    @classmethod
    def _assemble(cls, t: Model, dm: Model | None, draft_params: DraftPolicy,
                  spec_types: Sequence[str], ngram: NgramParams, n_vocab: int | None,
                  prompts: dict | None = None) -> Engine:
        sources = ngram_drafts(spec_types, ngram, n_vocab)
        prompts = {} if prompts is None else prompts  # a translating draft's, by the target's
        if dm is not None:
            sources.append(TranslateDraft(dm, t, prompts) if draft_params.translate
                           else ModelDraft(dm, n_vocab_target=t.n_vocab))
        source = combine(sources, draft_params.adaptive, draft_params.n_min)
        engine = cls(t, source, draft_params, ngram)
        engine._draft_prompts = prompts
        engine._sources[spec_key([*spec_types, *(["draft-simple"] if dm else [])])] = source
        return engine

    def source_for(self, spec_types: Sequence[str]) -> DraftSource | None:
        """The draft source for a request's own --spec-type list, built once per engine (an
        n-gram type's memory lasts across requests, as in llama.cpp); the draft model, if
        loaded, is shared. UsageError for a type this engine cannot serve."""
        key = spec_key(spec_types)
        if key not in self._sources:
            dm = self.draft_model
            if "draft-simple" in key and dm is None:
                raise UsageError("speculative type draft-simple needs a draft model",
                                 hint="start the server with -md")
            sources = ngram_drafts(key, self.ngram, self.target.n_vocab)
            if dm is not None and "draft-simple" in key:
                sources.append(
                    TranslateDraft(dm, self.target, self._draft_prompts)
                    if self.draft_params.translate
                    else ModelDraft(dm, n_vocab_target=self.target.n_vocab))
            self._sources[key] = combine(sources, self.draft_params.adaptive,
                                         self.draft_params.n_min)
        return self._sources[key]

    @property
    def draft_model(self) -> Model | None:
        """The draft model, whichever types the engine was loaded with."""
        return self.draft.model if self.draft is not None else None

    def forget(self) -> None:
        """Empty the caches: the next prompt is evaluated whole, nothing reused."""
        self.target.rewind(0)
        if self.draft_model is not None:
            self.draft_model.rewind(0)

    def close(self) -> None:
        self.target.close()
        if self.draft_model is not None:
            self.draft_model.close()

    # -- prompt -----------------------------------------------------------------------------
    def tokenize(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            return self.tokenize_messages([{"role": "user", "content": prompt}])
        return self.target.tokenize(self._fits(prompt))

    def tokenize_messages(self, messages: list[dict], continue_final: bool = False) -> list[int]:
        """A conversation rendered with the target's chat template (sandboxed, within a time
        and size budget; ChatML when the file has none), tokenized with special tokens
        parsed. What cannot fit the context is refused before the full work: more messages
        than the context has tokens, or more bytes than its tokens could spell.
        continue_final: continue the final assistant message (a prefill)."""
        text = self.render_messages(messages, continue_final)
        bos = self.target.special_text("bos")
        ids = self.target.tokenize(self._fits(text),
                                   add_special=not (bos and text.startswith(bos)))
        if self.draft_params.translate and self.draft_model is not None:
            self._remember_draft_prompt(ids, messages, continue_final)
        return ids

    def _remember_draft_prompt(self, ids: list[int], messages: list[dict],
                               continue_final: bool) -> None:
        """A draft with another tokenizer reads the conversation through its own chat
        template and special tokens (drafts/translate.py looks it up by the target's ids)."""
        from specli.chat import render_messages

        dm = self.draft_model
        template, builtin = chat_renderer(dm.chat_template(), self.target.params.jinja)
        bos = dm.special_text("bos")
        try:
            text = render_messages(template, messages, bos=bos, eos=dm.special_text("eos"),
                                   continue_final=continue_final, builtin=builtin)
        except UsageError:  # the draft's template refuses what the target's takes (roles):
            return  # the draft reads the prompt's text instead (TranslateDraft.begin)
        if len(self._draft_prompts) >= 64:  # recent prompts only (slots tokenize at once)
            self._draft_prompts.pop(next(iter(self._draft_prompts), None), None)
        self._draft_prompts[tuple(ids)] = dm.tokenize(
            text, add_special=not (bos and text.startswith(bos)))

    def render_messages(self, messages: list[dict], continue_final: bool = False) -> str:
        """The conversation as the prompt text tokenize_messages tokenizes."""
        from specli.chat import render_messages

        n_ctx = self.target.n_ctx
        if len(messages) > n_ctx:
            raise ContextOverflowError(
                f"{len(messages)} messages cannot fit a context of {n_ctx} tokens",
                hint="send fewer messages or raise -c/--ctx-size",
                n_prompt_tokens=len(messages), n_ctx=n_ctx)
        bos = self.target.special_text("bos")
        # the context's own bound on the output when the contents could reach it; short ones
        # skip measuring the vocabulary (RENDER_BYTES still bounds the template)
        size = sum(len(str(m.get("content") or "")) for m in messages)
        longest = self.target.max_token_bytes if size > n_ctx else None
        template, builtin = chat_renderer(self.target.chat_template(), self.target.params.jinja)
        try:
            return render_messages(template, messages, bos=bos,
                                   eos=self.target.special_text("eos"),
                                   max_bytes=n_ctx * longest if longest else None,
                                   continue_final=continue_final, builtin=builtin)
        except ContextOverflowError as e:  # more bytes than n_ctx tokens can spell
            e.n_prompt_tokens, e.n_ctx = n_ctx + 1, n_ctx  # a lower bound
            raise

    def _fits(self, text: str) -> str:
        """text, unless it is longer than any n_ctx tokens can spell (no token is longer than
        max_token_bytes): then ContextOverflowError, before tokenizing megabytes."""
        n_ctx = self.target.n_ctx
        if len(text) <= n_ctx:  # fits whatever the vocabulary: no need to measure it
            return text
        longest = self.target.max_token_bytes
        if len(text) > n_ctx * longest:  # a character is at least a byte
            raise ContextOverflowError(
                f"the prompt is {len(text)} characters: at most {longest} bytes a token, it "
                f"cannot fit a context of {n_ctx} tokens", hint="shorten the prompt or raise "
                "-c/--ctx-size", n_prompt_tokens=-(-len(text) // longest), n_ctx=n_ctx)
        return text

    # -- layer 1: the loop ------------------------------------------------------------------
    def steps(self, prompt: Sequence[int], n_predict: int, sp: SamplingParams, stats: Stats,
              speculative: bool = True, spec: SpecRequest | None = None,
              probs: list[TokenProbs] | None = None,
              progress: Callable[[dict], None] | None = None) -> Iterator[tuple[int, bool]]:
        """Yield (token, from_draft) for each emitted token; fills `stats` as it goes.

        n_predict < 0 means until an end-of-generation token or a full context. spec: this
        request's own draft types and lengths (the server's `speculative` object). probs:
        with sp.n_probs set, each token's TokenProbs is appended before the token is yielded.
        progress: called with llama-server's prompt_progress (total, cache, processed,
        time_ms) before and after each batch of the prompt.
        """
        tgt, policy = self.target, self.draft_params.overlay(spec)
        draft = self._source(spec) if speculative else None
        self._check(prompt, sp)
        rules = Rules.start(tgt, sp, prompt)  # a grammar is parsed before any work
        stats.seed = sp.seed if sp.seed is not None else secrets.randbits(32)
        rng = np.random.default_rng(stats.seed)
        stats.n_draft, stats.n_prompt = policy.n_draft if draft else 0, len(prompt)
        if draft is None or not self._tree(draft, policy, rules):
            policy = replace(policy, n_seq=1)  # this generation drafts one sequence a step
        stats.n_seq_dft = policy.n_seq
        meter = _Meter(stats, tgt, draft.model if draft else None)
        reads = None
        try:
            with meter.prompt():
                if draft:
                    reads = draft.begin(prompt)
                    if reads and reads.hidden:
                        tgt.set_hidden(True)
                # the last prompt token opens the first verification batch
                tgt.sync(prompt[:-1], _progress(progress, len(prompt)) if progress else None,
                         span=len(prompt), each=self._teller(draft, reads),
                         outputs=bool(reads and reads.hidden))
            context = list(prompt)  # committed; context[-1] is not yet in the target cache
            n_left = n_predict if n_predict >= 0 else tgt.n_ctx
            stats.finish_reason = "length"
            with meter.decode():
                t0 = time.perf_counter()
                while n_left > 0 and len(context) <= tgt.n_ctx:
                    # draft at most what the budget, the context and one batch can take
                    k = min(n_left - 1, tgt.n_ctx - len(context), tgt.n_batch - 1,
                            tgt.n_ctx if policy.limit is None else policy.limit) if draft else 0
                    tokens, n_drafted, eog = self._step(draft, policy, context, k, sp, rng,
                                                        stats, rules, probs, reads)
                    if not stats.n_first:  # llama-server's rates start after the first token
                        stats.n_first, stats.t_first_s = len(tokens), time.perf_counter() - t0
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
            if reads and reads.hidden:
                tgt.set_hidden(False)
            if draft:
                draft.end()
            if rules is not None:
                rules.close()

    def _step(self, draft: DraftSource | None, policy: DraftPolicy, context: list[int], k: int,
              sp: SamplingParams, rng: np.random.Generator, stats: Stats,
              rules: Rules | None = None, probs: list[TokenProbs] | None = None,
              reads: Reads | None = None) -> tuple[list[int], int, bool]:
        """One speculative step: (tokens to emit, how many of them the draft proposed, whether
        the target ended the generation). A drafted sequence is a tree of one branch. Whatever
        happens, both caches end at a committed length: the accepted path on success, the
        previous one on an exception (a failed decode, a closed stream)."""
        tree, path, token = _EMPTY, [], None
        try:
            # 1. propose (empty: the target decodes its next token alone)
            tree = self._propose(draft, policy, context, k, sp, rng, rules)
            # 2. verify: one target decode of [last token, *nodes], a logits row each
            rows = self._verify_batch(context, tree, draft, reads)
            row = _rows(rows, sp, context, tree, rules)
            path, token = verify_tree(tree, row, sp, rng)
            # 3. accept: the rules move past the target's token; an accepted
            # end-of-generation token ends the step as the target's
            if rules is not None and not self.target.is_eog(token):
                rules.accept(token)
            path, token = _cut_at_eog(tree, path, token, self.target.is_eog)
            if probs is not None and sp.n_probs is not None:
                _record_probs(probs, rows, row, tree, path, token, sp, self.target.is_eog)
        except (NonFinite, NoToken, TransformError) as e:
            raise _error(e, tree, stats.n_predict) from None
        finally:
            # 4. rewind both caches to the committed tokens; the draft learns how it went
            self._rewind(draft, context, tree, path, token)
        if len(tree):
            stats.record_step(len(tree), len(path), tree.source, depth=tree.max_depth,
                              branches=tree.n_branches)
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
        proposal = draft.propose(context, policy.k_for(draft, k), sp, rng, policy,
                                 **rules_kw(rules))
        if isinstance(proposal, Proposal):
            if rules is not None and rules.grammar is not None and proposal.tokens:
                proposal = _fit(proposal, rules)
            proposal = Tree.chain(proposal.tokens, proposal.q, proposal.source)
        return proposal if len(proposal) >= n_min or proposal.q else _EMPTY

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
            draft.process(Decoded(tokens, pos, seqs, tgt.hidden(len(tokens))
                                  if reads and reads.hidden else None))
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
        hidden = bool(reads and reads.hidden)

        def told(tokens: Sequence[int], pos0: int) -> None:
            draft.process(Decoded(tokens, range(pos0, pos0 + len(tokens)), None,
                                  self.target.hidden(len(tokens)) if hidden else None))

        return told

    def _tree(self, draft: DraftSource | None, policy: DraftPolicy,
              rules: Rules | None) -> bool:
        """Whether this generation drafts trees: more than one draft sequence, a draft model
        alone (not chained with n-gram types), no grammar or DRY (their state follows one
        path)."""
        return (policy.n_seq > 1 and rules is None and isinstance(draft, ModelDraft)
                and min(getattr(m, "n_branch", 1) for m in (self.target, draft.model))
                >= policy.n_seq)

    def _source(self, spec: SpecRequest | None) -> DraftSource | None:
        return self.draft if spec is None or spec.types is None else self.source_for(spec.types)

    def _check(self, prompt: Sequence[int], sp: SamplingParams) -> None:
        n_vocab = self.target.n_vocab
        bad = next((t for t, _ in sp.logit_bias if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise UsageError(f"logit bias for token {bad}, outside the vocabulary "
                             f"(0..{n_vocab - 1})")
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
               progress: Callable[[dict], None] | None = None) -> Iterator[Chunk]:
        """Text as it is decoded (UTF-8 split across tokens is held back); the last chunk has
        the finish reason and the stats. Closing the stream early closes the loop at once
        (caches rewound, `stats` complete)."""
        stats = stats if stats is not None else Stats()
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        probs: deque[TokenProbs] | None = deque() if sp.n_probs is not None else None
        steps = self.steps(prompt, n_predict, sp, stats, speculative, spec, probs, progress)
        try:
            for token, _ in steps:  # a chunk per token, "" while UTF-8 is held back
                yield Chunk(utf8.decode(self.target.token_bytes(token)), token=token,
                            probs=probs.popleft() if probs else None)
            yield Chunk(utf8.decode(b"", final=True), stats.finish_reason, stats)
        finally:
            steps.close()

    # -- layer 3: the whole answer ----------------------------------------------------------
    def complete(self, prompt: Sequence[int], n_predict: int, sp: SamplingParams,
                 speculative: bool = True, spec: SpecRequest | None = None) -> Completion:
        stats = Stats()
        tokens = [t for t, _ in self.steps(prompt, n_predict, sp, stats, speculative, spec)]
        text = b"".join(self.target.token_bytes(t) for t in tokens).decode("utf-8", "replace")
        return Completion(text, tokens, stats)


def check_files(target: ModelParams, draft: ModelParams | None,
                spec_types: Sequence[str], translate: bool = False) -> int | None:
    """The target's header is read once, before any weights: a damaged one is one clear error,
    metadata llama.cpp would abort on is refused (loadable.py), an incompatible draft is
    refused (unless it drafts through text: translate). Devices and buffer types are
    checked last. Returns the target's vocabulary size when it was read."""
    header = loadable.check_file(target.path)  # what llama.cpp would abort on, refused
    info = pairing.tokenizer_info(header)
    if draft is not None:
        draft_header = loadable.check_file(draft.path)
        if not translate:
            pairing.ensure_compatible(info, pairing.tokenizer_info(draft_header))
    n_vocab = info.n_vocab if draft is not None or "ngram-cache" in spec_types else None
    for params in (target, draft):
        if params is not None:
            check_placement(params)
    return n_vocab


MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: the sequences one context can hold


def check_tree(policy: DraftPolicy, draft: ModelParams | None,
               spec_types: Sequence[str]) -> bool:
    """Whether the engine drafts trees (more than one draft sequence); UsageError when the
    setting cannot: a tree needs a draft model, alone, and a fixed --draft."""
    if not 1 <= policy.n_seq <= MAX_DRAFT_SEQ:
        raise UsageError(f"--draft-n-seq {policy.n_seq} is out of range",
                         hint=f"1 to {MAX_DRAFT_SEQ} draft sequences")
    if not 0.0 <= policy.p_split <= 1.0:
        raise UsageError(f"--draft-p-split {policy.p_split} is not a probability",
                         hint="a value from 0 to 1 (default 0.1)")
    if policy.n_seq == 1:
        return False
    if draft is None:
        raise UsageError("draft trees (-np/--draft-n-seq > 1) need a draft model",
                         hint="give -md FILE")
    if any(t != "draft-simple" for t in spec_types):
        raise UsageError("draft trees (-np/--draft-n-seq > 1) draft with the model alone",
                         hint="drop the n-gram --spec-type, or use -np 1")
    if policy.translate:
        raise UsageError("draft trees (-np/--draft-n-seq > 1) need the draft's own tokenizer",
                         hint="use -np 1 with --spec-type draft-translate")
    if policy.adaptive:
        raise UsageError("draft trees (-np/--draft-n-seq > 1) take a fixed --draft",
                         hint="give --draft N instead of auto")
    return True


def chat_renderer(template: str | None, jinja: bool = True
                  ) -> tuple[str | None, Callable[[list[dict], bool], str] | None]:
    """How a chat template renders, as llama-server decides it: (Jinja source, None), or
    (None, llama.cpp's own renderer). With Jinja (the default) a template's source goes
    through the sandbox, "chatml" is ChatML and another llama.cpp built-in name (llama3,
    command-r...) is llama.cpp's renderer; without Jinja every template is llama.cpp's,
    recognised by its name or its text."""
    from specli.chat import FALLBACK_TEMPLATE

    if jinja and template == "chatml":
        return FALLBACK_TEMPLATE, None
    if jinja and template not in builtin_templates():
        return template, None
    # one llama.cpp does not recognise is ChatML, as llama-server falls back (serve warns)
    source = template if template and knows_template(template) else "chatml"
    return None, lambda messages, add: apply_builtin_template(source, messages, add)


def spec_key(spec_types: Sequence[str]) -> tuple[str, ...]:
    """A --spec-type list in llama.cpp's order of precedence, each type once."""
    return tuple(t for t in SPEC_TYPES if t in spec_types)


def ngram_drafts(spec_types: Sequence[str], ngram: NgramParams,
                 n_vocab: int | None = None) -> list[DraftSource]:
    """The n-gram sources the --spec-type names ask for, in llama.cpp's order of precedence.
    As in llama.cpp, each drafts up to its own m (n_max for ngram-mod) and ngram-cache, like
    llama-lookup, up to --draft: the step's DraftPolicy decides (k_for). Lookup-cache files
    are read here, token ids checked against n_vocab (the target's)."""
    unknown = set(spec_types) - set(SPEC_TYPES)
    if unknown:
        raise UsageError(f"unknown speculation type {', '.join(sorted(unknown))}",
                         hint=f"one of {', '.join(SPEC_TYPES)}")
    sources: list[DraftSource] = []
    if "ngram-simple" in spec_types:
        sources.append(NgramSimple(ngram.size_n, ngram.size_m))
    if "ngram-map-k" in spec_types:
        sources.append(NgramMap(ngram.map_k_size_n, ngram.map_k_size_m, ngram.map_k_min_hits,
                                key_only=True))
    if "ngram-map-k4v" in spec_types:
        sources.append(NgramMap(ngram.map_k4v_size_n, ngram.map_k4v_size_m,
                                ngram.map_k4v_min_hits, key_only=False))
    if "ngram-mod" in spec_types:
        sources.append(NgramMod(ngram.mod_n_match, ngram.mod_n_max, ngram.mod_n_min))
    if "ngram-cache" in spec_types:
        sources.append(NgramCache.from_files(ngram.lookup_static, ngram.lookup_dynamic, n_vocab))
    return sources


def combine(sources: Sequence[DraftSource], adaptive: bool = False,
            n_min: int = 0) -> DraftSource | None:
    """One source, a Chain of several (first proposal wins), or None; with `adaptive`
    (--draft auto) each gets its own k, over one shared verification-cost model."""
    if adaptive:
        cost = VerifyCost()
        # an n-gram proposal exists only when a long context matched: usually right
        sources = [Adaptive(s, cost, seed=i, prior=0.7 if isinstance(s, ModelDraft) else 0.9,
                            n_min=max(n_min, 1)) for i, s in enumerate(sources)]
    return None if not sources else sources[0] if len(sources) == 1 else Chain(sources)


class _Meter:
    """Wall-clock buckets per model, for the prompt and for the generation: the seconds inside
    each model's decodes, its decode calls and tokens (llama_perf_context would bill one
    context's work to the other when two are interleaved)."""

    def __init__(self, stats: Stats, target: Model, draft: Model | None):
        stats.target = ModelPerf(load_ms=target.load_ms)
        stats.draft = ModelPerf(load_ms=draft.load_ms) if draft is not None else None
        self.stats = stats
        self.models = [(target, stats.target)] + ([(draft, stats.draft)] if draft else [])

    @contextmanager
    def prompt(self) -> Iterator[None]:
        t0, before = time.perf_counter(), [_usage(m) for m, _ in self.models]
        yield
        self.stats.t_encode_s = time.perf_counter() - t0
        for (m, perf), b in zip(self.models, before, strict=True):
            secs, _, perf.prompt_n = _since(m, b)
            perf.prompt_ms = 1e3 * secs

    @contextmanager
    def decode(self) -> Iterator[None]:
        t0, before = time.perf_counter(), [_usage(m) for m, _ in self.models]
        try:
            yield
        finally:
            s = self.stats
            s.t_decode_s = time.perf_counter() - t0
            for (m, perf), b in zip(self.models, before, strict=True):
                secs, perf.eval_runs, perf.eval_n = _since(m, b)
                perf.eval_ms = 1e3 * secs
            s.t_target_decode_s = s.target.eval_ms / 1e3
            s.t_draft_decode_s = s.draft.eval_ms / 1e3 if s.draft is not None else 0.0


def _progress(report: Callable[[dict], None], total: int) -> Callable[[int, int], None]:
    """sync's progress as llama-server reports it, batches cut over the whole prompt: the
    last prompt token, decoded at once by the first verification, counts in the last."""
    t0 = time.perf_counter()

    def on_progress(cache: int, done: int) -> None:
        report({"total": total, "cache": cache, "processed": done,
                "time_ms": 1e3 * (time.perf_counter() - t0)})

    return on_progress


def _rows(rows: np.ndarray, sp: SamplingParams, context: list[int], tree: Tree,
          rules: Rules | None = None) -> Callable[[int, list[int]], np.ndarray]:
    """Row r of a verification batch as the sampler sees it: transformed with the history it
    follows (the context, then the nodes of `path` above it), then through the rules (DRY,
    the grammar's mask). verify_tree descends one path, asking for a row only once the node
    above it is accepted: the rules move past the path's tokens then."""
    if not sp.transforms and rules is None:
        return lambda r, path: rows[r]
    n = sp.repeat_last_n
    tail = context if n < 0 else context[-n:] if n > 0 else []
    need = need_for(sp, rows.shape[1])
    moved = 0  # path tokens the rules have moved past
    done: dict[int, np.ndarray] = {}  # a row asked for again is the same row

    def row(r: int, path: list[int]) -> np.ndarray:
        nonlocal moved
        if r in done:
            return done[r]
        above = [tree.tokens[i] for i in path]
        x = transform(rows[r], sp, [*tail, *above])
        if rules is not None:
            for t in above[moved:]:
                rules.accept(t)
            moved = max(moved, len(above))
            x = rules.apply(x, need)
        done[r] = x
        return x

    return row


_EMPTY = Tree()  # no nodes: the target decodes the last token alone


def _cut_at_eog(tree: Tree, path: list[int], token: int,
                is_eog: Callable[[int], bool]) -> tuple[list[int], int]:
    """The accepted path up to its first end-of-generation token, which becomes the
    target's token (it ends the generation)."""
    cut = next((j for j, i in enumerate(path) if is_eog(tree.tokens[i])), None)
    return (path, token) if cut is None else (path[:cut], tree.tokens[path[cut]])


def _record_probs(probs: list[TokenProbs], rows: np.ndarray,
                  row: Callable[[int, list[int]], np.ndarray], tree: Tree, path: list[int],
                  token: int, sp: SamplingParams, is_eog: Callable[[int], bool]) -> None:
    """Each emitted token's probabilities, from the rows verify used: exactly the target's at
    each emitted position."""
    for i, t in enumerate([*(tree.tokens[j] for j in path), token]):
        if is_eog(t):
            continue
        r = 0 if i == 0 else path[i - 1] + 1
        if not sp.post_sampling_probs:  # the raw row's softmax
            probs.append(token_probs(rows[r], t, sp.n_probs))
        elif sp.greedy:  # the greedy chain keeps one token
            probs.append(TokenProbs(t, 1.0, ((t, 1.0),) if sp.n_probs else ()))
        else:  # the distribution the chain drew from
            probs.append(sampled_probs(sampling_dist(row(r, path[:i]), sp, r), t, sp.n_probs))


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


def _fit(proposal: Proposal, rules: Rules) -> Proposal:
    """The proposal up to its first token the grammar refuses (checked on a fork)."""
    g = rules.fork()
    try:
        n = 0
        for t in proposal.tokens:
            if not g.allows(t):
                break
            g.accept(t)
            n += 1
    finally:
        g.close()
    if n == len(proposal.tokens):
        return proposal
    return Proposal(proposal.tokens[:n], proposal.q[:n] if proposal.q is not None else None,
                    proposal.source)


def _usage(m: Model | None) -> tuple[float, int, int]:
    """(seconds inside llama_decode, decode calls, tokens decoded) so far."""
    return (m.t_decode_s, m.n_decode_calls, m.n_decode_tokens) if m is not None else (0.0, 0, 0)


def _since(m: Model | None, before: tuple[float, int, int]) -> tuple[float, int, int]:
    now = _usage(m)
    return now[0] - before[0], now[1] - before[1], now[2] - before[2]
