"""THE engine: speculative decoding over a target Model and an optional DraftSource.

Three layers, after mlx-lm: `steps()` yields raw (token, from_draft) events, `stream()` yields
text chunks with finish reasons, `complete()` returns the text and its Stats. Nothing here
prints; the CLI and the server format what the loop records in Stats.
"""

from __future__ import annotations

import codecs
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from specli import pairing
from specli.backend import Gate, Model, SharedContext, check_placement
from specli.config import (
    DEFAULT_DRAFT_MAX,
    SPEC_TYPES,
    DraftParams,
    ModelParams,
    NgramParams,
    SamplingParams,
    SpecRequest,
)
from specli.drafts import (
    Adaptive,
    Capped,
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
from specli.errors import ContextOverflowError, UsageError
from specli.ggufmeta import read_header
from specli.stats import ModelPerf, Stats
from specli.verify import verify


@dataclass
class Chunk:
    """A piece of generated text; the last chunk of a stream carries finish_reason and stats."""

    text: str
    finish_reason: str | None = None
    stats: Stats | None = None


@dataclass
class Completion:
    text: str
    tokens: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)


class Engine:
    def __init__(self, target: Model, draft: DraftSource | None = None,
                 draft_params: DraftParams | None = None, ngram: NgramParams | None = None):
        self.target = target
        self.draft = draft
        self.draft_params = draft_params or DraftParams()
        self.ngram = ngram or NgramParams()
        self._sources: dict[tuple[str, ...], DraftSource | None] = {}  # per-request types

    @classmethod
    def load(cls, target: ModelParams, draft: ModelParams | None = None,
             draft_params: DraftParams | None = None, spec_types: Sequence[str] = (),
             ngram: NgramParams | None = None) -> Engine:
        """Check the pair from GGUF metadata first (refuse before loading weights), then load.

        spec_types: llama.cpp's --spec-type names; n-gram types take precedence over the draft
        model, which is used whenever `draft` is given."""
        draft_params = draft_params or DraftParams()
        ngram = ngram or NgramParams()
        n_vocab = check_files(target, draft, spec_types)
        t = Model(target)
        try:
            dm = Model(draft) if draft is not None else None
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
                   draft_params: DraftParams | None = None, spec_types: Sequence[str] = (),
                   ngram: NgramParams | None = None) -> tuple[list[Engine], list[SharedContext]]:
        """n engines (server slots) over one target context and one draft context, a sequence
        each, whose simultaneous decodes are batched together; n_ctx is per slot. Returns the
        engines and the shared contexts, which the caller closes. A generation on a slot runs
        between `shared[0].gate.enter()` and `.leave()`, so that decodes wait for it."""
        draft_params = draft_params or DraftParams()
        ngram = ngram or NgramParams()
        n_vocab = check_files(target, draft, spec_types)
        gate = Gate()
        shared = [SharedContext(target, n, gate)]
        try:
            if draft is not None:
                shared.append(SharedContext(draft, n, gate, first=True))
            engines = [cls._assemble(shared[0].view(i), shared[1].view(i) if draft else None,
                                     draft_params, spec_types, ngram, n_vocab)
                       for i in range(n)]
        except BaseException:
            for c in shared:
                c.close()
            raise
        return engines, shared

    @classmethod
    def _assemble(cls, t: Model, dm: Model | None, draft_params: DraftParams,
                  spec_types: Sequence[str], ngram: NgramParams, n_vocab: int | None) -> Engine:
        sources = ngram_drafts(spec_types, ngram, n_vocab, draft_params.n_max,
                               cap=draft_params.cap_ngram)
        if dm is not None:
            sources.append(ModelDraft(dm, draft_params.p_min, n_vocab_target=t.n_vocab,
                                      n_max=draft_params.n_max))
        source = combine(sources, draft_params.adaptive, draft_params.n_min)
        engine = cls(t, source, draft_params, ngram)
        engine._sources[spec_key([*spec_types, *(["draft-simple"] if dm else [])])] = source
        return engine

    def source_for(self, spec_types: Sequence[str]) -> DraftSource | None:
        """The draft source for a request's own --spec-type list, built once per engine (an
        n-gram type's memory lasts across requests, as in llama.cpp); the draft model, if
        loaded, is shared. UsageError for a type this engine cannot serve."""
        key = spec_key(spec_types)
        if key not in self._sources:
            dm = self.model_draft
            if "draft-simple" in key and dm is None:
                raise UsageError("speculative type draft-simple needs a draft model",
                                 hint="start the server with -md")
            p = self.draft_params
            sources = ngram_drafts(key, self.ngram, self.target.n_vocab, p.n_max,
                                   cap=p.cap_ngram)
            self._sources[key] = combine(
                [*sources, *([dm] if dm is not None and "draft-simple" in key else [])],
                p.adaptive, p.n_min)
        return self._sources[key]

    @property
    def model_draft(self) -> ModelDraft | None:
        """The draft model's source, whichever types the engine was loaded with."""
        return _model_source(self.draft)

    def close(self) -> None:
        self.target.close()
        dm = _model_draft(self.draft)
        if dm is not None:
            dm.close()

    # -- prompt -----------------------------------------------------------------------------
    def tokenize(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            return self.tokenize_messages([{"role": "user", "content": prompt}])
        return self.target.tokenize(prompt)

    def tokenize_messages(self, messages: list[dict]) -> list[int]:
        """A conversation rendered with the target's chat template (sandboxed; ChatML when the
        file has none), tokenized with special tokens parsed."""
        from specli.chat import render_messages

        bos = self.target.special_text("bos")
        text = render_messages(self.target.chat_template(), messages, bos=bos,
                               eos=self.target.special_text("eos"))
        return self.target.tokenize(text, add_special=not (bos and text.startswith(bos)))

    # -- layer 1: the loop ------------------------------------------------------------------
    def steps(self, prompt: Sequence[int], n_predict: int, sp: SamplingParams, stats: Stats,
              speculative: bool = True,
              spec: SpecRequest | None = None) -> Iterator[tuple[int, bool]]:
        """Yield (token, from_draft) for each emitted token; fills `stats` as it goes.

        n_predict < 0 means until an end-of-generation token or a full context. spec: this
        request's own draft types and lengths (the server's `speculative` object).
        """
        tgt = self.target
        spec = spec or SpecRequest()
        draft = None
        if speculative:
            draft = self.draft if spec.types is None else self.source_for(spec.types)
        n_cap = spec.n_max if spec.n_max is not None else tgt.n_ctx
        n_min = max(spec.n_min if spec.n_min is not None else self.draft_params.n_min, 1)
        if not prompt:
            raise UsageError("empty prompt", hint="give -p TEXT or -f FILE with some text")
        if len(prompt) >= tgt.n_ctx:
            raise ContextOverflowError(
                f"prompt is {len(prompt)} tokens, the context holds {tgt.n_ctx}",
                hint="raise -c/--ctx-size or shorten the prompt")
        stats.seed = sp.seed if sp.seed is not None else secrets.randbits(32)
        rng = np.random.default_rng(stats.seed)
        stats.n_draft = min(self.draft_params.n_max, n_cap) if draft else 0
        stats.n_prompt = len(prompt)
        stats.target = ModelPerf(load_ms=tgt.load_ms)
        dm = _model_draft(draft)
        if dm is not None:
            stats.draft = ModelPerf(load_ms=dm.load_ms)
        md = self.model_draft if dm is not None else None
        p_min = md.p_min if md is not None else 0.0

        t0, tgt0, dm0 = time.perf_counter(), _usage(tgt), _usage(dm)
        tgt.sync(prompt[:-1])  # the last prompt token opens the first verification batch
        if draft:
            draft.begin(prompt)
        stats.t_encode_s = time.perf_counter() - t0
        for perf, m, m0 in ((stats.target, tgt, tgt0), (stats.draft, dm, dm0)):
            if perf is not None:
                secs, _, tokens = _since(m, m0)
                perf.prompt_ms, perf.prompt_n = 1e3 * secs, tokens

        context = list(prompt)  # committed tokens; context[-1] is not yet in the target cache
        n_past = len(prompt) - 1
        n_left = n_predict if n_predict >= 0 else tgt.n_ctx
        t0, tgt0, dm0 = time.perf_counter(), _usage(tgt), _usage(dm)
        stats.finish_reason = "length"
        if md is not None and spec.p_min is not None:
            md.p_min = spec.p_min  # this engine serves one request at a time: restored below
        try:
            while n_left > 0 and n_past < tgt.n_ctx:
                # draft at most what the budget, the context and one target batch can take;
                # each source applies its own cap (--draft, an n-gram type's m)
                k = min(n_left - 1, tgt.n_ctx - n_past - 1, tgt.n_batch - 1, n_cap) \
                    if draft else 0
                proposal, n_acc, token = self._step(draft, context, n_past, k, n_min, sp, rng)
                if proposal.tokens:
                    stats.record_step(len(proposal.tokens), n_acc, proposal.source)
                    draft.observe(n_acc)  # 5. observe: where adaptive draft lengths live
                n_past += 1 + n_acc
                for i, t in enumerate([*proposal.tokens[:n_acc], token]):
                    if tgt.is_eog(t):
                        stats.finish_reason = "stop"
                        return
                    context.append(t)
                    stats.n_predict += 1
                    n_left -= 1
                    yield t, i < n_acc
        finally:
            if md is not None:
                md.p_min = p_min
            if draft:
                draft.end()
            stats.t_decode_s = time.perf_counter() - t0
            stats.t_target_decode_s, stats.target.eval_runs, stats.target.eval_n = \
                _since(tgt, tgt0)
            stats.target.eval_ms = 1e3 * stats.t_target_decode_s
            if dm is not None:
                stats.t_draft_decode_s, stats.draft.eval_runs, stats.draft.eval_n = \
                    _since(dm, dm0)
                stats.draft.eval_ms = 1e3 * stats.t_draft_decode_s

    def _step(self, draft: DraftSource | None, context: list[int], n_past: int, k: int,
              n_min: int, sp: SamplingParams,
              rng: np.random.Generator) -> tuple[Proposal, int, int]:
        """One speculative step: (proposal, accepted count, next token). Whatever happens,
        both caches end at a committed length: the accepted prefix on success, the previous
        one on an exception (a failed decode, a closed stream)."""
        n_keep = n_past
        try:
            # 1. propose; a draft shorter than --draft-min is not worth a verification
            proposal = draft.propose(context, k, sp, rng) if draft and k >= n_min else Proposal()
            if len(proposal.tokens) < n_min:
                proposal = Proposal()
            # 2. verify: one target decode of [last token, *draft], a logits row per token
            rows = self.target.decode([context[-1], *proposal.tokens], logits="all")
            # 3. accept (an accepted end-of-generation token ends the step as the target's)
            n_acc, token = verify(proposal.tokens, proposal.q, rows.__getitem__, sp, rng)
            for j in range(n_acc):
                if self.target.is_eog(proposal.tokens[j]):
                    n_acc, token = j, proposal.tokens[j]
                    break
            n_keep = n_past + 1 + n_acc
            return proposal, n_acc, token
        finally:
            # 4. rewind both caches past the first rejection
            self.target.rewind(n_keep)
            if draft:
                draft.rewind(n_keep)

    # -- layer 2: text ----------------------------------------------------------------------
    def stream(self, prompt: Sequence[int], n_predict: int, sp: SamplingParams,
               speculative: bool = True, spec: SpecRequest | None = None) -> Iterator[Chunk]:
        stats = Stats()
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for token, _ in self.steps(prompt, n_predict, sp, stats, speculative, spec):
            text = utf8.decode(self.target.token_bytes(token))
            if text:
                yield Chunk(text)
        yield Chunk(utf8.decode(b"", final=True), stats.finish_reason, stats)

    # -- layer 3: the whole answer ----------------------------------------------------------
    def complete(self, prompt: Sequence[int], n_predict: int, sp: SamplingParams,
                 speculative: bool = True, spec: SpecRequest | None = None) -> Completion:
        stats = Stats()
        tokens = [t for t, _ in self.steps(prompt, n_predict, sp, stats, speculative, spec)]
        text = b"".join(self.target.token_bytes(t) for t in tokens).decode("utf-8", "replace")
        return Completion(text, tokens, stats)


def check_files(target: ModelParams, draft: ModelParams | None,
                spec_types: Sequence[str]) -> int | None:
    """The target's header is read once, before any weights: a damaged one is one clear error,
    an incompatible draft is refused; the tokenizer is parsed only when a pair or a lookup
    cache needs it. Devices and buffer types are checked last. Returns the target's
    vocabulary size when it was read."""
    n_vocab = None
    if draft is None and "ngram-cache" not in spec_types:
        read_header(target.path)
    else:
        info = pairing.read_tokenizer(target.path)
        if draft is not None:
            pairing.ensure_compatible(info, draft.path)
        n_vocab = info.n_vocab
    for params in (target, draft):
        if params is not None:
            check_placement(params)
    return n_vocab


def spec_key(spec_types: Sequence[str]) -> tuple[str, ...]:
    """A --spec-type list in llama.cpp's order of precedence, each type once."""
    return tuple(t for t in SPEC_TYPES if t in spec_types)


def ngram_drafts(spec_types: Sequence[str], ngram: NgramParams, n_vocab: int | None = None,
                 n_draft: int = DEFAULT_DRAFT_MAX, cap: bool = False) -> list[DraftSource]:
    """The n-gram sources the --spec-type names ask for, in llama.cpp's order of precedence.
    As in llama.cpp, each drafts up to its own m (n_max for ngram-mod), or n_draft with `cap`;
    ngram-cache, like llama-lookup, up to n_draft. Lookup-cache files are read here, token
    ids checked against n_vocab (the target's)."""
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
    if cap:
        sources = [Capped(s, n_draft) for s in sources]
    if "ngram-cache" in spec_types:
        sources.append(NgramCache.from_files(ngram.lookup_static, ngram.lookup_dynamic, n_vocab,
                                             n_draft))
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


def _model_draft(draft: DraftSource | None) -> Model | None:
    """The draft model's backend, if a model drafts (alone or in a chain)."""
    src = _model_source(draft)
    return src.model if src is not None else None


def _model_source(draft: DraftSource | None) -> ModelDraft | None:
    for s in draft.sources if isinstance(draft, Chain) else [draft]:
        s = s.source if isinstance(s, Adaptive) else s
        if isinstance(s, ModelDraft):
            return s
    return None


def _usage(m: Model | None) -> tuple[float, int, int]:
    """(seconds inside llama_decode, decode calls, tokens decoded) so far."""
    return (m.t_decode_s, m.n_decode_calls, m.n_decode_tokens) if m is not None else (0.0, 0, 0)


def _since(m: Model | None, before: tuple[float, int, int]) -> tuple[float, int, int]:
    now = _usage(m)
    return now[0] - before[0], now[1] - before[1], now[2] - before[2]
