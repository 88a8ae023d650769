"""The speculative plan, resolved once: which sources draft (llama.cpp's --spec-type names, the
draft model, its trees) and how much, checked before any weights load; then the engines
built from it. run, serve, tune-draft and the server's routes resolve their plans here.
Errors are about the plan (PlanError.field names the setting at fault): each front end
names its own flag or request parameter for it. A command resolves its plan once, checks its
files once (check_files) and hands it to open_engine or open_slots (the server's through its
state); a request's own settings are checked against it once (SpecPlan.request)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from specli import loadable, pairing
from specli.backend import (
    Backend,
    HeadContext,
    HeadModel,
    Model,
    check_placement,
    require_head,
)
from specli.batching import Scheduler, SharedContext
from specli.config import (
    SPEC_TYPES,
    DraftPolicy,
    ModelParams,
    NgramParams,
    PlanError,
    SpecRequest,
    literal,
)
from specli.drafts import (
    Adaptive,
    Batch,
    Chain,
    DraftSource,
    ModelDraft,
    NgramCache,
    NgramMap,
    NgramMod,
    NgramSimple,
    VerifyCost,
)
from specli.drafts.heads import DflashDraft, Eagle3Draft, MtpDraft
from specli.drafts.translate import TranslateDraft
from specli.engine import Engine
from specli.errors import SpecliError
from specli.headmeta import A_HEAD, HEAD_TYPES, HeadInfo, check_head, head_info

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: the sequences one context can hold


@dataclass(frozen=True)
class SpecPlan:
    """What drafts and how much. types: the sources in llama.cpp's order of precedence,
    "draft-simple" for the draft model, which drafts whenever one is loaded (draft: whether
    one is); policy: the draft lengths, trees and translation; ngram: the n-gram types'
    settings."""

    types: tuple[str, ...] = ()
    policy: DraftPolicy = field(default_factory=DraftPolicy)
    ngram: NgramParams = field(default_factory=NgramParams)
    draft: bool = False
    head: HeadInfo | None = None  # the draft file's head, when it is one

    @classmethod
    def resolve(cls, spec_types: Sequence[str] = (), draft: bool = False,
                policy: DraftPolicy | None = None, ngram: NgramParams | None = None,
                head: HeadInfo | None = None) -> SpecPlan:
        """The plan for these settings, or PlanError for one that cannot run. head: what the
        draft file is when it is a head (draft_head), which then drafts as its own type."""
        policy, ngram = policy or DraftPolicy(), ngram or NgramParams()
        types = spec_key(spec_types)
        if ("draft-simple" in types or policy.translate) and not draft:
            raise PlanError("drafting with a model (draft-simple, draft-translate) needs a "
                            "draft model", "draft")
        heads = [t for t in types if t in HEAD_TYPES]
        if draft and not heads and head is not None and "draft-simple" not in types:
            # the file says which (llama.cpp's inference from the draft file)
            heads = [head.spec_type]
            types = spec_key([*types, *heads])
        _check_head(types, heads, draft, head, policy)
        own = ["draft-simple"] if draft and not heads else []
        plan = cls(spec_key([*types, *own]), policy, ngram, draft, head if heads else None)
        plan._check_tree()
        return plan

    @property
    def head_type(self) -> str | None:
        """The draft head's type, if the plan drafts with one."""
        return next((t for t in self.types if t in HEAD_TYPES), None)

    def _check_tree(self) -> None:
        """A tree (more than one draft sequence) needs a draft model, alone, with its own
        tokenizer (its fixed length and ranges: DraftPolicy's own checks)."""
        p = self.policy
        if p.n_seq == 1:
            return
        if not self.draft:
            raise PlanError("draft trees (more than one draft sequence) need a draft model",
                            "draft")
        if self.types != ("draft-simple",):
            raise PlanError("draft trees draft with the model alone, not n-gram types too",
                            "types")
        if p.translate:
            raise PlanError("draft trees need the draft's own tokenizer, not translation",
                            "types")

    @property
    def tree(self) -> bool:
        """Whether it drafts trees: more than one draft sequence."""
        return self.policy.n_seq > 1

    def serves(self, spec_types: Sequence[str] | None) -> tuple[str, ...]:
        """A type list in order of precedence (None: the plan's); PlanError for one the
        loaded models cannot serve."""
        if spec_types is None:
            return self.types
        types = spec_key(spec_types)
        if "draft-simple" in types and (not self.draft or self.head_type):
            raise PlanError("speculative type draft-simple needs a draft model", "draft")
        other = next((t for t in types if t in HEAD_TYPES and t != self.head_type), None)
        if other:
            raise PlanError(f"speculative type {other} needs its head loaded"
                            + (f"; this server's is {self.head_type}" if self.head_type
                               else ""), "types")
        return types

    def request(self, spec: SpecRequest | None) -> SpecRequest | None:
        """A request's own settings checked against the plan, once (its values checked
        themselves): its types in order of precedence, and no more draft sequences than the
        contexts were made for; PlanError names the setting."""
        if spec is None or spec.checked:
            return spec
        types = None if spec.types is None else self.serves(spec.types)
        if spec.n_seq is not None and spec.n_seq > self.policy.n_seq:
            raise PlanError(f"{{n_seq}} {spec.n_seq} is more than the {self.policy.n_seq} "
                            "draft sequences the models were loaded for", "n_seq")
        return replace(spec, types=types, checked=True)

    def types_of(self, spec: SpecRequest | None) -> tuple[str, ...]:
        """The types a checked request drafts with: its own, else the plan's."""
        return self.types if spec is None or spec.types is None else spec.types


def _check_head(types: Sequence[str], heads: Sequence[str], draft: bool,
                head: HeadInfo | None, policy: DraftPolicy) -> None:
    """A head drafts alone (no draft model beside it), from its own file (the target's own
    layers for MTP), at one draft sequence, through the target's tokenizer."""
    if len(heads) > 1 or heads and "draft-simple" in types:
        raise PlanError("one draft model or head at a time: "
                        + ", ".join(t for t in types if t == "draft-simple" or t in HEAD_TYPES),
                        "types")
    if not heads:
        if head is not None and "draft-simple" in types:
            raise PlanError(f"the draft file is {A_HEAD[head.spec_type]}, not a draft model: "
                            f"use --spec-type {head.spec_type}", "types")
        return
    kind = heads[0]
    if kind == "draft-mtp" and draft and (head is None or head.spec_type != kind):
        raise PlanError("draft-mtp drafts with the target's own prediction layers, or a "
                        "draft file's (an MTP sidecar): the draft file has none", "types")
    if kind != "draft-mtp" and not draft:
        raise PlanError(f"{kind} drafts with {A_HEAD[kind]}, and no draft file was given",
                        "head")
    if kind != "draft-mtp" and head is None:
        raise PlanError(f"{kind} drafts with {A_HEAD[kind]}, and the draft file is a draft "
                        "model, not a head", "head")
    if kind != "draft-mtp" and head.spec_type != kind:
        raise PlanError(f"{kind} drafts with {A_HEAD[kind]}, and the draft file is "
                        f"{A_HEAD[head.spec_type]}: use --spec-type {head.spec_type}", "types")
    if policy.translate:
        raise PlanError(f"{kind} reads the target's states: translation is for a draft model",
                        "types")


def spec_key(spec_types: Sequence[str]) -> tuple[str, ...]:
    """A --spec-type list in llama.cpp's order of precedence, each type once; PlanError names
    a type specli does not have."""
    unknown = set(spec_types) - set(SPEC_TYPES)
    if unknown:
        raise PlanError(f"unknown speculation type {literal(', '.join(sorted(unknown)))}: one of "
                        f"{', '.join(SPEC_TYPES)}", "types")
    return tuple(t for t in SPEC_TYPES if t in spec_types)


class Drafts:
    """One engine's draft sources (a server slot's own): for each type list, built once (an
    n-gram type's memory lasts across requests, as in llama.cpp) around one draft-model or
    head source, whose model (or head context) the slot's draft is."""

    def __init__(self, plan: SpecPlan, target: Model, draft: Backend | HeadContext | None,
                 batch: Batch | None = None):
        self.plan, self.target, self.batch = plan, target, batch
        self.model_draft = (None if draft is None else
                            head_source(plan, draft, target) if plan.head_type else
                            TranslateDraft(draft, target) if plan.policy.translate else
                            ModelDraft(draft, n_vocab_target=target.n_vocab))
        if batch is not None and type(self.model_draft) is ModelDraft:
            self.model_draft.lazy = True  # its prompt fed when the batch's plan drafts
        self._sources: dict[tuple[str, ...], DraftSource | None] = {}

    def __call__(self, spec: SpecRequest | None = None) -> DraftSource | None:
        """The source for a request's types (None: the plan's), checked against the plan
        unless it was (SpecPlan.request)."""
        if spec is not None and not spec.checked:
            spec = self.plan.request(spec)
        key = self.plan.types_of(spec)
        if key not in self._sources:
            sources = ngram_drafts(key, self.plan.ngram, self.target.n_vocab)
            if "draft-simple" in key or self.plan.head_type in key:
                sources.append(self.model_draft)
            self._sources[key] = combine(sources, self.plan.policy.adaptive,
                                         self.plan.policy.n_min, self.batch)
        return self._sources[key]

    def expect(self, draft_prompt: Sequence[int] | None) -> None:
        """The draft's own tokens for the next prompt (a chat rendered through its own
        template), for a draft that translates; None: it reads the prompt's text."""
        if isinstance(self.model_draft, TranslateDraft):
            self.model_draft.draft_prompt = None if draft_prompt is None else list(draft_prompt)


def head_source(plan: SpecPlan, head: HeadContext, target: Model) -> DraftSource:
    """The draft head's source, as the plan's head type and file say."""
    kind, info = plan.head_type, plan.head
    if kind == "draft-mtp":
        return MtpDraft(head, head.n_nextn, target.n_vocab)
    if kind == "draft-eagle3":
        return Eagle3Draft(head, info.layers, target.n_vocab)
    return DflashDraft(head, info.layers, target.n_vocab, block_size=info.block_size,
                       mask=info.mask, dspark=kind == "draft-dspark",
                       from_anchor=info.from_anchor)


def draft_head(draft: ModelParams | str | None) -> HeadInfo | None:
    """What a draft file is when it is a head (None: a model, or no file), from its header;
    a damaged header is left to check_files."""
    if draft is None:
        return None
    try:
        # read, not checked: a head llama.cpp would abort on is still a head, and
        # check_files says what is wrong with it
        return head_info(loadable.read(getattr(draft, "path", draft)))
    except SpecliError:  # a damaged header: check_files says so too
        return None


def ngram_drafts(spec_types: Sequence[str], ngram: NgramParams,
                 n_vocab: int | None = None) -> list[DraftSource]:
    """The n-gram sources the --spec-type names ask for, in llama.cpp's order of precedence.
    As in llama.cpp, each drafts up to its own m (n_max for ngram-mod) and ngram-cache, like
    llama-lookup, up to --draft: the step's DraftPolicy decides (k_for). Lookup-cache files
    are read here, token ids checked against n_vocab (the target's)."""
    spec_key(spec_types)
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
            n_min: int = 0, batch: Batch | None = None) -> DraftSource | None:
    """One source, a Chain of several (first proposal wins), or None; with `adaptive`
    (--draft auto) each gets its own k, over one shared verification-cost model (a server
    slot's: its batch's, for which its k is chosen)."""
    if adaptive:
        cost, who = VerifyCost(), object()  # who: the slot, in its batch's plans
        # an n-gram proposal exists only when a long context matched: usually right
        sources = [Adaptive(s, cost, seed=i, prior=0.7 if isinstance(s, ModelDraft) else 0.9,
                            n_min=max(n_min, 1), batch=batch, who=who)
                   for i, s in enumerate(sources)]
    return None if not sources else sources[0] if len(sources) == 1 else Chain(sources)


def check_files(target: ModelParams, draft: ModelParams | None, plan: SpecPlan) -> None:
    """The target's header is read once, before any weights: a damaged one is one clear error,
    metadata llama.cpp would abort on is refused (loadable.py), an incompatible draft is
    refused (unless it drafts through text: translate). Devices and buffer types are
    checked last."""
    header = loadable.check_file(target.path)  # what llama.cpp would abort on, refused
    info = pairing.tokenizer_info(header)
    draft_header = loadable.check_file(draft.path) if draft is not None else None
    if plan.head_type:  # this llama-cpp-python can run it, and the head fits the target
        require_head(plan.head_type)
        check_head(header, plan.head or HeadInfo("draft-mtp", target.path), draft_header)
    if draft_header is not None:
        if not plan.policy.translate:
            pairing.ensure_compatible(info, pairing.tokenizer_info(draft_header))
    for params in (target, draft):
        if params is not None:
            check_placement(params)


def _matches(plan: SpecPlan, draft: ModelParams | None) -> None:
    """A plan handed in is the one for these files: a draft model whenever it drafts with one."""
    if plan.draft != (draft is not None):
        raise PlanError("the plan " + ("drafts with a draft model, and none was given"
                                       if plan.draft else "has no draft model, and one was "
                                       "given"), "draft")


def load(target: ModelParams, draft: ModelParams | None = None,
         draft_params: DraftPolicy | None = None, spec_types: Sequence[str] = (),
         ngram: NgramParams | None = None) -> Engine:
    """An engine: the plan resolved and the pair checked from GGUF metadata first (refused
    before loading weights), then the models loaded. spec_types: llama.cpp's --spec-type
    names; n-gram types take precedence over the draft model, which drafts whenever `draft`
    is given."""
    plan = SpecPlan.resolve(spec_types, draft is not None, draft_params, ngram,
                            draft_head(draft))
    check_files(target, draft, plan)
    return open_engine(target, draft, plan)


def open_engine(target: ModelParams, draft: ModelParams | None, plan: SpecPlan) -> Engine:
    """An engine over the files of a plan resolved and checked already (check_files), as
    run and tune-draft do before they load: the models loaded, the sources built."""
    _matches(plan, draft)
    n_seq = plan.policy.n_seq
    mtp = plan.head_type == "draft-mtp"
    t = (Model(target, n_seq_max=n_seq, tree=True) if plan.tree else
         Model(replace(target, mtp=True)) if mtp and draft is None else Model(target))
    try:
        head = replace(draft, mtp=True) if mtp and draft is not None else draft
        dm = (HeadContext(t, head) if plan.head_type else None if draft is None else
              Model(draft, n_seq_max=n_seq, tree=True) if plan.tree else Model(draft))
    except BaseException:
        t.close()
        raise
    try:
        return engine(plan, t, dm)
    except BaseException:
        t.close()
        if dm is not None:
            dm.close()
        raise


def load_slots(n: int, target: ModelParams, draft: ModelParams | None = None,
               draft_params: DraftPolicy | None = None, spec_types: Sequence[str] = (),
               ngram: NgramParams | None = None) -> tuple[list[Engine], list[SharedContext]]:
    """n engines (server slots) over one target context and one draft context, a sequence
    each, whose simultaneous decodes are batched together; n_ctx is per slot. Returns the
    engines and the shared contexts, which the caller closes. The slots' decodes are
    combined when their generations run as tasks of the one loop (`shared[0].sched.submit`,
    as the server's slots do); called from other threads, each decode is a task of its own.
    The plan resolved and the files checked first, as load's."""
    plan = SpecPlan.resolve(spec_types, draft is not None, draft_params, ngram,
                            draft_head(draft))
    check_files(target, draft, plan)
    return open_slots(n, target, draft, plan)


def open_slots(n: int, target: ModelParams, draft: ModelParams | None,
               plan: SpecPlan) -> tuple[list[Engine], list[SharedContext]]:
    """load_slots' engines over the files of a plan resolved and checked already (serve
    checks before it listens)."""
    _matches(plan, draft)
    width = plan.policy.n_seq
    if n * width > MAX_SEQUENCES:
        raise PlanError(f"{n} slots of {width} draft sequences are {n * width} sequences; "
                        f"llama.cpp holds at most {MAX_SEQUENCES}", "slots")
    # a tree adds at most k + 1 nodes to the target's cells, (k - 1) a branch to the draft's
    cells = width * (plan.policy.n_max + 1) if width > 1 else 0
    sched = Scheduler()
    batch = Batch() if plan.policy.adaptive else None  # timed by the target's decodes
    mtp = plan.head_type == "draft-mtp"
    shared = [SharedContext(replace(target, mtp=True) if mtp and draft is None else target, n,
                            sched, width=width, tree_cells=cells,
                            timed=batch.cost.add if batch else None)]
    try:
        if plan.head_type:  # a head context a slot, on one head model (freed after them)
            head = (HeadModel(replace(draft, mtp=mtp)) if draft is not None else None)
            if head is not None:
                shared.append(head)
            views = [shared[0].view(i) for i in range(n)]
            engines = [engine(plan, v, HeadContext(v, head, decoder=sched), batch, slot=True)
                       for v in views]
            return engines, shared
        if draft is not None:
            shared.append(SharedContext(draft, n, sched, first=True, width=width,
                                        tree_cells=cells,
                                        timed=batch.draft.add if batch else None))
        engines = [engine(plan, shared[0].view(i), shared[1].view(i) if draft else None, batch,
                          slot=True) for i in range(n)]
    except BaseException:
        for c in shared:
            c.close()
        raise
    return engines, shared


def engine(plan: SpecPlan, target: Backend, draft: Backend | None,
           batch: Batch | None = None, slot: bool = False) -> Engine:
    """An engine over target (and draft) that drafts as the plan says, its sources per slot
    (a real model, a slot's view, or a test's fake); batch: the slots it shares decodes with
    (--draft auto chooses its k for them); slot: a server's (its first token the target's
    alone, Engine.first_plain)."""
    drafts = Drafts(plan, target, draft, batch)
    e = Engine(target, drafts(), plan.policy, drafts=drafts)
    e.first_plain = slot
    params = getattr(target, "params", None)  # a test's fake has no ModelParams
    if isinstance(params, ModelParams):
        e.context_shift, e.n_keep = params.context_shift, params.n_keep
    return e
