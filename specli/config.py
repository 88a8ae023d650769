"""Parameters as frozen dataclasses; every default lives here and nowhere else."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from specli.errors import UsageError

# llama.cpp's --spec-type names specli has, in llama.cpp's order of precedence
SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache",
              "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")


def parse_spec_types(text: str) -> tuple[str, ...]:
    """A --spec-type list (llama.cpp's names, comma-separated); ValueError names what is
    unknown. The CLI and the server's `speculative.type` read it the same way."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in SPEC_TYPES]
    if unknown or not names:
        raise ValueError(", ".join(unknown) or repr(text))
    return names


DRAFT_AUTO_MAX = 64  # --draft auto chooses k up to this (llama.cpp's largest n-gram default)
DEFAULT_DRAFT_MAX = 8
MAX_DRAFT_SEQ = 64  # draft-tree branches (llama.cpp's contexts take up to 256 sequences)
DEFAULT_CTX = 4096
DEFAULT_N_PREDICT = 256


def usable_cpus() -> int:
    """The CPUs this process may run on (taskset, a container's cpuset), not the machine's:
    a thread more than that spins against its siblings on a shared core."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


DEFAULT_THREADS = min(usable_cpus(), 8)  # llama.cpp: the physical cores


@dataclass(frozen=True)
class Knob:
    """One sampling parameter, declared once: SamplingParams' field, its llama.cpp flags, its
    name in a request and in generation_settings (`name`), its environment variable and help,
    and the values it takes: a number from `low` (excluded when `above`) to `high`. A value
    below `unset` is no value (a negative seed: a random one; dry_base below 1, as llama.cpp
    reads it: the value it had). The CLI's flags, the server's request schema, a request's
    overlay on the server's settings and generation_settings are all derived from SAMPLING;
    the checks run in one place, SamplingParams itself."""

    field: str
    flags: tuple[str, ...]
    help: str
    kind: type = float
    api: str | None = None
    envvar: str | None = None
    low: float | None = None
    above: bool = False
    high: float | None = None
    unset: float | None = None

    @property
    def name(self) -> str:
        """Its name in a request and in generation_settings."""
        return self.api or self.field

    def default(self):
        """The field's default (None: the field takes None, as no value)."""
        return getattr(SamplingParams, self.field)

    def read(self, value, base: SamplingParams | None = None):
        """A value as a flag or a request gives it, as the field holds it over `base` (the
        defaults, or a server's settings): below `unset`, base's value, or None where the
        default is None (the seed: a random one, whatever the server's)."""
        if self.unset is not None and isinstance(value, int | float) \
                and not isinstance(value, bool) and math.isfinite(value) and value < self.unset:
            default = self.default()
            return None if default is None else getattr(base or SamplingParams, self.field)
        return value

    def schema(self) -> dict:
        """Its range in JSON Schema's words (a value below `unset` is no value: no minimum)."""
        out = {} if self.high is None else {"maximum": self.high}
        if self.low is not None and self.unset is None:
            out["exclusiveMinimum" if self.above else "minimum"] = self.low
        return out

    span = "from {low} to {high}"  # a range with both bounds, in words

    def rule(self) -> str:
        """What its values must be, in words (bounds in their own type: 2 not 2.0)."""
        low, high = (None if b is None else f"{b:g}" if self.kind is float else str(int(b))
                     for b in (self.low, self.high))
        if low is not None and high is not None:
            return self.span.format(low=low, high=high)
        if low is not None:
            return f"above {low}" if self.above else f"{low} or more"
        return "a finite number" if self.kind is float else "an integer"

    def complaint(self, value) -> str | None:
        """Why value cannot be this field's, or None."""
        if value is None and self.default() is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int if self.kind is int
                                                      else (int, float)):
            return "must be a number" if self.kind is float else "must be an integer"
        if not math.isfinite(value):
            return "must be a finite number"
        if (self.low is not None and (value < self.low or (value == self.low and self.above))) \
                or (self.high is not None and value > self.high):
            return f"must be {self.rule()}"
        return None


class SamplingError(UsageError):
    """A sampling value out of its range: knob names the parameter; each face says it with
    its own name for it (`named`)."""

    def __init__(self, knob: Knob, value, complaint: str):
        self.knob, self.value, self.complaint = knob, value, complaint
        super().__init__(self.named(knob.field))

    def named(self, name: str) -> str:
        return f"{name} {self.complaint}, got {self.value!r}"


# in the order of llama.cpp's --help; temp <= 0 is greedy
SAMPLING = (
    Knob("temp", ("--temp", "--temperature"), "Temperature; 0 is greedy.", api="temperature",
         envvar="LLAMA_ARG_TEMPERATURE", low=0),
    Knob("top_k", ("--top-k",), "Top-k; 0 disables.", int, envvar="LLAMA_ARG_TOP_K"),
    Knob("top_p", ("--top-p",), "Top-p; 1.0 disables.", envvar="LLAMA_ARG_TOP_P", low=0,
         high=1),
    Knob("min_p", ("--min-p",), "Min-p; 0.0 disables.", envvar="LLAMA_ARG_MIN_P", low=0,
         high=1),
    Knob("seed", ("-s", "--seed"), "RNG seed; -1 picks one at random.", int, low=0,
         high=2**63 - 1, unset=0),
    Knob("repeat_last_n", ("--repeat-last-n",),
         "Last n tokens to penalize; 0 disables, -1 the context.", int,
         envvar="LLAMA_ARG_REPEAT_LAST_N", low=-1),
    Knob("repeat_penalty", ("--repeat-penalty",), "Penalize repeated tokens; 1.0 disables.",
         envvar="LLAMA_ARG_REPEAT_PENALTY", low=0, above=True),
    Knob("presence_penalty", ("--presence-penalty",),
         "Subtracted once from a token seen in the last n; 0 disables.",
         envvar="LLAMA_ARG_PRESENCE_PENALTY"),
    Knob("frequency_penalty", ("--frequency-penalty",),
         "Subtracted per occurrence in the last n; 0 disables.",
         envvar="LLAMA_ARG_FREQUENCY_PENALTY"),
    Knob("dry_multiplier", ("--dry-multiplier",),
         "DRY repetition penalty multiplier; 0.0 disables.", envvar="LLAMA_ARG_DRY_MULTIPLIER",
         low=0),
    Knob("dry_base", ("--dry-base",), "DRY base value.", envvar="LLAMA_ARG_DRY_BASE", unset=1),
    Knob("dry_allowed_length", ("--dry-allowed-length",),
         "DRY: repetitions longer than this are penalized.", int,
         envvar="LLAMA_ARG_DRY_ALLOWED_LENGTH", low=0),
    Knob("dry_penalty_last_n", ("--dry-penalty-last-n",),
         "DRY: tokens to scan; 0 disables, -1 the context.", int,
         envvar="LLAMA_ARG_DRY_PENALTY_LAST_N", low=-1),
)
DRY_BREAKERS_MAX = 64  # --dry-sequence-breaker / dry_sequence_breakers


@dataclass(frozen=True)
class SamplingParams:
    """Target (and draft) sampling. temp <= 0 means greedy. Defaults are llama.cpp's."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None  # None: a fresh random seed, reported in the stats
    # logit transforms, before the chain (llama.cpp's order: logit bias, then penalties over
    # the last repeat_last_n tokens of prompt and output; -1: the whole context)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias); -inf bans; repeats add
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # DRY (llama.cpp's "don't repeat yourself"): off while dry_multiplier is 0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # -1: the whole context
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    grammar: str | None = None  # GBNF; every token, drafted or sampled, must fit it
    # report each token's probability and the n_probs most likely (None: none); from the
    # target's own row, or after the sampling chain (post_sampling_probs)
    n_probs: int | None = None
    post_sampling_probs: bool = False

    def __post_init__(self):
        """Every value in its range (SAMPLING's), so that a bad one is refused here, before
        anything runs, with the parameter's name: SamplingError."""
        for knob in SAMPLING:
            value = getattr(self, knob.field)
            complaint = knob.complaint(value)
            if complaint is not None:
                raise SamplingError(knob, value, complaint)
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0 or math.isnan(bias):
                raise SamplingError(_BIAS, (token, bias), "must be a token id and a number")
        if len(self.dry_sequence_breakers) > DRY_BREAKERS_MAX:
            raise SamplingError(_BREAKERS, len(self.dry_sequence_breakers),
                                f"must be at most {DRY_BREAKERS_MAX} strings")
        if self.n_probs is not None and not 0 <= self.n_probs <= 100:
            raise SamplingError(_N_PROBS, self.n_probs, "must be from 0 to 100")

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0

    def banning(self, tokens: Sequence[int]) -> SamplingParams:
        """These settings with `tokens` never sampled, their logits -inf (for the draft's
        checks too): llama.cpp's --ignore-eos, with the end-of-generation tokens."""
        return replace(self, logit_bias=(*self.logit_bias, *((t, -math.inf) for t in tokens)))

    @property
    def penalized(self) -> bool:
        """Whether the repetition penalties change anything (llama.cpp's is_disabled)."""
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or
                                            self.frequency_penalty != 0.0 or
                                            self.presence_penalty != 0.0)

    @property
    def transforms(self) -> bool:
        """Whether rows are transformed before the chain (verify.transform)."""
        return bool(self.logit_bias) or self.penalized


# the checks on SamplingParams' other fields, named for the error
_BIAS = Knob("logit_bias", ("-l", "--logit-bias"), "")
_BREAKERS = Knob("dry_sequence_breakers", ("--dry-sequence-breaker",), "")
_N_PROBS = Knob("n_probs", ("--n-probs",), "")


class PlanError(UsageError):
    """A drafting setting, or a plan, that cannot run. field: the setting at fault (a
    DRAFTING knob's field, or "types", "draft" (the draft model), "head" (the draft file a
    head type needs), "slots"). The message names
    settings as {field} (a brace of its own text doubled: `literal`); each face says it with
    its own names for them (`said`: the CLI its flags, the server its request fields),
    `message` with the fields' own."""

    def __init__(self, message: str, field: str):
        self.text, self.field = message, field
        super().__init__(self.said({}))

    def said(self, names: Mapping[str, str]) -> str:
        """The message with each setting called by `names` (the field's own name if absent)."""
        def name(m: re.Match) -> str:
            if m[1] is None:
                return m[0][0]  # a doubled brace
            return names.get(m[1], m[1]) if m[1] in PLAN_FIELDS else m[0]

        return re.sub(r"\{\{|\}\}|\{(\w+)\}", name, self.text)


def literal(text: str) -> str:
    """Text (a name a user gave) as it reads inside a PlanError's message."""
    return text.replace("{", "{{").replace("}", "}}")


@dataclass(frozen=True)
class DraftKnob(Knob):
    """One drafting setting, declared once: DraftPolicy's field and a request's
    `speculative` field of the same name, its llama.cpp flags, help, environment variables
    (the newer spelling first) and range. The CLI's drafting flags and the server's
    `speculative` schema derive from DRAFTING; DraftPolicy and SpecRequest check themselves
    against it (PlanError, the field named)."""

    envvars: tuple[str, ...] = ()
    metavar: str | None = None
    span = "between {low} and {high}"

    def default(self):
        return getattr(DraftPolicy, self.field)

    def check(self, value) -> None:
        """PlanError naming the field for a value out of its range."""
        complaint = self.complaint(value)
        if complaint is not None:
            raise PlanError(f"{{{self.field}}} {complaint}, got {value!r}", self.field)


# in the order of llama.cpp's --help
DRAFTING = (
    DraftKnob("n_max", ("--draft", "--draft-max", "--draft-n", "--spec-draft-n-max"),
              "Most tokens drafted per step (k). Default: 8 for the draft model and "
              "ngram-cache, while the other n-gram types draft up to their own m, as in "
              "llama.cpp; given explicitly, K caps them too. `auto`: k chosen each step, per "
              "source, from the measured acceptance and cost (up to "
              f"{DRAFT_AUTO_MAX}, 0 included: the target alone); on serve, for the whole "
              "batch of slots, and serve's default.", int, low=1,
              envvars=("LLAMA_ARG_SPEC_DRAFT_N_MAX", "LLAMA_ARG_DRAFT_MAX"), metavar="K|auto"),
    DraftKnob("n_min", ("--draft-min", "--spec-draft-n-min", "--draft-n-min"),
              "A draft shorter than this is not verified.", int, low=0,
              envvars=("LLAMA_ARG_SPEC_DRAFT_N_MIN", "LLAMA_ARG_DRAFT_MIN")),
    DraftKnob("p_min", ("--draft-p-min", "--spec-draft-p-min"),
              "Stop drafting when the draft's top probability falls below this.", low=0,
              high=1, envvars=("LLAMA_ARG_SPEC_DRAFT_P_MIN", "LLAMA_ARG_DRAFT_P_MIN")),
    DraftKnob("n_seq", ("--draft-n-seq", "--spec-draft-n-seq"),
              "Draft sequences: more than 1 drafts a tree, as llama-speculative's -np, a branch "
              "splitting where the draft's next candidate is above --draft-p-split; the target "
              "verifies every node in one batch. Needs a draft model alone (no n-gram types) "
              "and a fixed --draft, which caps the tree's nodes.", int, low=1,
              high=MAX_DRAFT_SEQ, envvars=("LLAMA_ARG_SPEC_DRAFT_N_SEQ",)),
    DraftKnob("p_split", ("--draft-p-split", "--spec-draft-p-split"),
              "A draft tree branches where the draft's next candidate is more likely than "
              "this (with --draft-n-seq or run's -np above 1).", low=0, high=1,
              envvars=("LLAMA_ARG_SPEC_DRAFT_P_SPLIT",)),
)
PLAN_FIELDS = frozenset([*(k.field for k in DRAFTING), "types", "draft", "slots", "sampling"])
# how a sampled draft is verified (--spec-sampling, a request's speculative.sampling): exact
# samples the target at every position with the request's seeded generator and accepts a
# drafted token while it equals the sample (llama-server's rule: one seed, one text, with
# or without a draft); rejection accepts x with probability min(1, p(x)/q(x)) (Leviathan/
# Chen: the same distribution, more tokens accepted at high temperatures, another text)
SPEC_SAMPLING = ("exact", "rejection")


def _check_drafting(values: object) -> None:
    """DraftPolicy's or SpecRequest's DRAFTING fields in their ranges (None: not given), and
    n_min no more than n_max."""
    for knob in DRAFTING:
        value = getattr(values, knob.field)
        if value is not None:
            knob.check(value)
    n_min, n_max = values.n_min, values.n_max
    if n_min is not None and n_max is not None and n_min > n_max:
        raise PlanError(f"{{n_min}} must be between 0 and {{n_max}} ({n_max}), got {n_min}",
                        "n_min")


def _check_sampling(value: str | None) -> None:
    if value is not None and value not in SPEC_SAMPLING:
        raise PlanError(f"{{sampling}} must be one of {', '.join(SPEC_SAMPLING)}, got "
                        f"{literal(repr(value))}", "sampling")


@dataclass(frozen=True)
class SpecRequest:
    """One request's own speculative settings (the server's `speculative` object); None keeps
    the engine's. types: --spec-type names (the draft model drafts only if draft-simple is
    among them); n_max caps every source's k. Checks its values itself (PlanError); checked:
    checked against the engine's plan too (SpecPlan.request, which orders the types): an
    engine checks a request that is not."""

    types: tuple[str, ...] | None = None
    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None
    n_seq: int | None = None  # draft-tree branches, up to the engine's (tune-draft's sweep)
    p_split: float | None = None
    sampling: str | None = None  # SPEC_SAMPLING's
    checked: bool = field(default=False, compare=False)

    def __post_init__(self):
        _check_drafting(self)
        _check_sampling(self.sampling)
        unknown = [t for t in self.types or () if t not in SPEC_TYPES]
        if unknown:
            raise PlanError(f"unknown speculation type {literal(', '.join(unknown))}: one of "
                            f"{', '.join(SPEC_TYPES)}", "types")


@dataclass(frozen=True)
class DraftPolicy:
    """How much to draft (llama.cpp's --draft-max/--draft-min/--draft-p-min), decided once per
    step: the engine's settings with a request's own on top (`overlay`). n_max caps the draft
    model and ngram-cache; the other n-gram types draft up to their own m unless cap_ngram
    (--draft given explicitly). limit: a request's own n_max, which caps every source.
    adaptive: --draft auto, k chosen each step. n_seq, p_split: a draft tree of up to n_seq
    branches (llama-speculative's -np), a branch splitting where the draft's next candidate
    is more likely than p_split (--draft-p-split). translate: --spec-type draft-translate,
    a draft model with another tokenizer (drafts/translate.py). sampling: how a sampled
    draft is verified (SPEC_SAMPLING). Checks its values itself against DRAFTING (PlanError
    naming the field), a tree's fixed length included."""

    n_max: int = DEFAULT_DRAFT_MAX
    n_min: int = 0
    p_min: float = 0.0
    adaptive: bool = False
    cap_ngram: bool = False
    limit: int | None = None
    n_seq: int = 1
    p_split: float = 0.1
    translate: bool = False  # the draft model has another tokenizer: go through the text
    sampling: str = "exact"  # SPEC_SAMPLING's: how a sampled draft is verified

    def __post_init__(self):
        _check_drafting(self)
        _check_sampling(self.sampling)
        if self.limit is not None:
            DRAFTING[0].check(self.limit)
        if self.n_seq > 1 and self.adaptive:
            raise PlanError("a draft tree ({n_seq} above 1) takes a fixed {n_max}, not auto",
                            "n_max")

    def overlay(self, request: SpecRequest | None) -> DraftPolicy:
        """This policy with a request's own n_min, p_min and n_max (as the limit) on top."""
        if request is None:
            return self
        return replace(
            self, n_min=self.n_min if request.n_min is None else request.n_min,
            p_min=self.p_min if request.p_min is None else request.p_min,
            limit=self.limit if request.n_max is None else request.n_max,
            n_seq=self.n_seq if request.n_seq is None else request.n_seq,
            p_split=self.p_split if request.p_split is None else request.p_split,
            sampling=self.sampling if request.sampling is None else request.sampling)

    @property
    def exact(self) -> bool:
        """Whether a sampled draft is verified by matching the target's own sample."""
        return self.sampling == "exact"

    def k_for(self, own_length: bool, k: int) -> int:
        """The most tokens a source drafts in a step that can take k: --draft caps it unless
        it drafts to its own length (own_length: the n-gram types that have an m)."""
        if self.cap_ngram or not own_length:
            return min(k, self.n_max)
        return k

    @property
    def n_draft(self) -> int:
        """The configured k, as the statistics report it."""
        return min(self.n_max, self.limit) if self.limit is not None else self.n_max


DraftParams = DraftPolicy  # its name before the policy was one object (the public API keeps it)


@dataclass(frozen=True)
class NgramParams:
    """n-gram drafting, with llama.cpp's defaults: n (key length) and m (most tokens drafted)
    for ngram-simple, ngram-map-k and ngram-map-k4v; k4v's min hits; ngram-mod's match length
    and draft bounds; ngram-cache's lookup-cache files."""

    size_n: int = 12
    size_m: int = 48
    map_k_size_n: int = 12
    map_k_size_m: int = 48
    map_k_min_hits: int = 1
    map_k4v_size_n: int = 12
    map_k4v_size_m: int = 48
    map_k4v_min_hits: int = 1
    mod_n_match: int = 24
    mod_n_max: int = 64
    mod_n_min: int = 48
    lookup_static: str | None = None
    lookup_dynamic: str | None = None


@dataclass(frozen=True)
class ModelParams:
    """One GGUF model and the context that runs it."""

    path: str
    n_ctx: int = DEFAULT_CTX
    n_batch: int = 2048
    n_ubatch: int = 512
    n_gpu_layers: int = 0
    n_threads: int | None = DEFAULT_THREADS  # None: measured (-t auto, specli/threads.py)
    n_threads_batch: int | None = None  # None: same as n_threads (measured, if that is)
    type_k: str | None = None  # KV cache types, llama.cpp names (f16, q8_0, ...); None: default
    type_v: str | None = None
    flash_attn: str = "auto"  # on | off | auto: llama.cpp's C default is auto
    verbose: bool = False
    # where the layers go (llama.cpp's -dev, -sm, -ts, -mg, -ot/-cmoe/-ncmoe)
    devices: tuple[str, ...] | None = None  # offload devices by name; None: all, (): none
    split_mode: str = "layer"  # none | layer | row | tensor
    tensor_split: tuple[float, ...] = ()  # proportions per device; (): llama.cpp decides
    main_gpu: int = 0
    tensor_overrides: tuple[tuple[str, str], ...] = ()  # (tensor name regex, buffer type)
    rpc: tuple[str, ...] = ()  # llama.cpp RPC servers (HOST:PORT) whose devices join these
    # the chat template, replacing the file's (--chat-template): Jinja source, or the name of
    # one llama.cpp renders itself (llama3, command-r...); jinja=False (--no-jinja) renders
    # every template through llama.cpp's built-in renderers, as llama-server without --jinja
    chat_template: str | None = None
    jinja: bool = True
    mtp: bool = False  # load its multi-token-prediction layers too (draft-mtp)
    use_mmap: bool = True  # --no-mmap: read the weights into memory instead of mapping them
    use_mlock: bool = False  # --mlock: keep them in RAM (never swapped out)
    warmup: bool = True  # one decode at load, as llama.cpp's (--no-warmup: none)
    # llama.cpp's --context-shift (off by default, as there) and --keep: a full context
    # drops the older half after the first n_keep tokens (-1: the prompt) and goes on
    context_shift: bool = False
    n_keep: int = 0
