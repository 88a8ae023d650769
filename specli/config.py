"""Parameters as frozen dataclasses; every default lives here and nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

# llama.cpp's --spec-type names specli has, in llama.cpp's order of precedence
SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache",
              "draft-simple")


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
DEFAULT_THREADS = min(os.cpu_count() or 1, 8)  # llama.cpp: the physical cores


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

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0

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


@dataclass(frozen=True)
class SpecRequest:
    """One request's own speculative settings (the server's `speculative` object); None keeps
    the engine's. types: --spec-type names (the draft model drafts only if draft-simple is
    among them); n_max caps every source's k."""

    types: tuple[str, ...] | None = None
    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None
    n_seq: int | None = None  # draft-tree branches, up to the engine's (tune-draft's sweep)
    p_split: float | None = None


@dataclass(frozen=True)
class DraftPolicy:
    """How much to draft (llama.cpp's --draft-max/--draft-min/--draft-p-min), decided once per
    step: the engine's settings with a request's own on top (`overlay`). n_max caps the draft
    model and ngram-cache; the other n-gram types draft up to their own m unless cap_ngram
    (--draft given explicitly). limit: a request's own n_max, which caps every source.
    adaptive: --draft auto, k chosen each step. n_seq, p_split: a draft tree of up to n_seq
    branches (llama-speculative's -np), a branch splitting where the draft's next candidate
    is more likely than p_split (--draft-p-split). translate: --spec-type draft-translate,
    a draft model with another tokenizer (drafts/translate.py)."""

    n_max: int = DEFAULT_DRAFT_MAX
    n_min: int = 0
    p_min: float = 0.0
    adaptive: bool = False
    cap_ngram: bool = False
    limit: int | None = None
    n_seq: int = 1
    p_split: float = 0.1
    translate: bool = False  # the draft model has another tokenizer: go through the text

    def overlay(self, request: SpecRequest | None) -> DraftPolicy:
        """This policy with a request's own n_min, p_min and n_max (as the limit) on top."""
        if request is None:
            return self
        return replace(
            self, n_min=self.n_min if request.n_min is None else request.n_min,
            p_min=self.p_min if request.p_min is None else request.p_min,
            limit=self.limit if request.n_max is None else request.n_max,
            n_seq=self.n_seq if request.n_seq is None else request.n_seq,
            p_split=self.p_split if request.p_split is None else request.p_split)

    def k_for(self, source: object, k: int) -> int:
        """The most tokens `source` drafts in a step that can take k: --draft caps it unless
        it drafts to its own length (`own_length`: the n-gram types that have an m)."""
        if self.cap_ngram or not getattr(source, "own_length", False):
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
    n_threads: int = DEFAULT_THREADS
    n_threads_batch: int | None = None  # None: same as n_threads
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
