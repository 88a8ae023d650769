"""Draft/target compatibility from GGUF metadata alone (no weights loaded).

One policy, `check_pair`, used by engine load and by `specli check-pair`: llama.cpp's rules
from common/speculative.cpp, so a pair specli accepts is one llama.cpp accepts too. `compare`
adds what a user wants to know before loading both: the fields side by side, and warnings that
do not fail (pre-tokenizer, chat template, relative size, architecture family).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import asdict, dataclass, fields

from specli.errors import IncompatiblePairError
from specli.ggufmeta import Header, gguf_constants, invalid, read_header
from specli.headmeta import HEAD_ARCHS

# llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE and SPEC_VOCAB_CHECK_START_TOKEN_ID
VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5
# the seeds' rule of thumb: a draft of at most 5% (seed 000) to 20% (seed 002, "5-20x
# smaller") of the target's parameters; above 20% a draft costs too much to pay off
DRAFT_RATIO_IDEAL = 0.05
DRAFT_RATIO_MAX = 0.20

TOKENS, MERGES = "tokenizer.ggml.tokens", "tokenizer.ggml.merges"


@dataclass(frozen=True)
class TokenizerInfo:
    """Tokenizer metadata with llama.cpp's defaults filled in where a key is absent."""

    path: str
    architecture: str | None
    model: str | None  # tokenizer.ggml.model: gpt2, llama, ...
    pre: str | None
    tokens: tuple[str, ...]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool | None
    add_eos: bool | None
    eot_id: int | None = None
    pad_id: int | None = None
    tokens_sha256: str | None = None  # of the token list as stored in the file
    merges_sha256: str | None = None
    n_merges: int = 0
    chat_template: str | None = None

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def to_dict(self) -> dict:
        t = self.chat_template
        return {
            "model": self.model, "vocab_type": vocab_type(self.model), "pre": self.pre,
            "n_vocab": self.n_vocab, "bos_id": self.bos_id, "add_bos": self.add_bos,
            "eos_id": self.eos_id, "add_eos": self.add_eos, "eot_id": self.eot_id,
            "pad_id": self.pad_id, "tokens_sha256": self.tokens_sha256,
            "merges_sha256": self.merges_sha256, "n_merges": self.n_merges,
            "chat_template": t is not None,
            "chat_template_sha256": _sha(t) if t is not None else None,
        }


@dataclass(frozen=True)
class ModelInfo:
    """What `check-pair` and `info` say about one file, from its header alone."""

    path: str
    file_size: int
    architecture: str | None
    name: str | None
    size_label: str  # general.size_label, else rounded from the parameter count
    n_params: int  # from the tensor shapes
    file_type: str | None  # Q4_K_M, F16, ...
    context_length: int | None
    n_tensors: int
    tensor_types: dict[str, int]  # GGML type -> tensor count
    tokenizer: TokenizerInfo

    def to_dict(self) -> dict:
        # not asdict(self): it would copy the tokenizer's whole token list, one call a token
        # (262,144 for Gemma), only to drop it
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tokenizer"}
        d["tensor_types"] = dict(self.tensor_types)
        d["tokenizer"] = self.tokenizer.to_dict()
        return d


@dataclass(frozen=True)
class Verdict:
    ok: bool
    rule: str | None = None  # the first rule that failed
    message: str = "compatible"


def read_tokenizer(path: str) -> TokenizerInfo:
    """Read the tokenizer metadata of a GGUF file; ModelFileError if it is not a readable GGUF."""
    return tokenizer_info(read_header(path, {TOKENS}))


def read_model_info(path: str) -> ModelInfo:
    """Everything `check-pair` compares, from the header and tensor index only."""
    return model_info(read_header(path, {TOKENS}))


# the value types llama.cpp's loader accepts for the keys specli reads: any other is an error
# there (a file llama.cpp cannot load must not get a verdict here)
_ID = {"UINT32", "INT32"}
_KEY_TYPES = {
    "general.architecture": {"STRING"}, "general.name": {"STRING"},
    "general.size_label": {"STRING"}, "general.file_type": _ID,
    "tokenizer.ggml.model": {"STRING"}, "tokenizer.ggml.pre": {"STRING"},
    "tokenizer.chat_template": {"STRING"}, TOKENS: {"ARRAY[STRING]"}, MERGES: {"ARRAY[STRING]"},
    "tokenizer.ggml.bos_token_id": _ID, "tokenizer.ggml.eos_token_id": _ID,
    "tokenizer.ggml.eot_token_id": _ID, "tokenizer.ggml.padding_token_id": _ID,
    "tokenizer.ggml.add_bos_token": {"BOOL"}, "tokenizer.ggml.add_eos_token": {"BOOL"},
}


def check_types(h: Header) -> None:
    arch = h.kv.get("general.architecture")
    wanted = dict(_KEY_TYPES)
    if isinstance(arch, str):
        wanted[f"{arch}.context_length"] = {"UINT32", "UINT64", "INT32"}
    for key, allowed in wanted.items():
        if key in h.types and h.types[key] not in allowed:
            raise invalid(h.path, f"{key} is {h.types[key]}, expected "
                          f"{' or '.join(sorted(allowed))}")


def tokenizer_info(h: Header) -> TokenizerInfo:
    check_types(h)
    kv = h.kv
    model, pre = kv.get("tokenizer.ggml.model"), kv.get("tokenizer.ggml.pre")
    if model == "gemma4":  # llama.cpp: this tokenizer implies its pre-tokenizer
        pre = "gemma4"
    tokens = tuple(kv.get(TOKENS, ()))
    bos, eos, add_bos, add_eos = _defaults(model, pre)
    add_bos = kv.get("tokenizer.ggml.add_bos_token", add_bos)
    if vocab_type(model) == "bpe" and pre in ("gemma4", "granite-embed-multi-311m"):
        add_bos = True  # llama.cpp forces BOS on for Gemma 4 whatever the file says
    tokens_info, merges = h.arrays.get(TOKENS), h.arrays.get(MERGES)

    def special(key: str, default: int | None) -> int | None:
        # llama.cpp drops a default outside the vocabulary and ignores a file's id outside it
        if default is not None and default >= len(tokens):
            default = None
        v = kv.get(key)
        return v if v is not None and 0 <= v < len(tokens) else default

    return TokenizerInfo(
        path=h.path,
        architecture=kv.get("general.architecture"),
        model=model,
        pre=pre,
        tokens=tokens,
        bos_id=special("tokenizer.ggml.bos_token_id", bos),
        eos_id=special("tokenizer.ggml.eos_token_id", eos),
        add_bos=add_bos,
        add_eos=kv.get("tokenizer.ggml.add_eos_token", add_eos),
        eot_id=special("tokenizer.ggml.eot_token_id", None),
        pad_id=special("tokenizer.ggml.padding_token_id", None),
        tokens_sha256=tokens_info.sha256 if tokens_info else None,
        merges_sha256=merges.sha256 if merges else None,
        n_merges=merges.count if merges else 0,
        chat_template=kv.get("tokenizer.chat_template"),
    )


def model_info(h: Header) -> ModelInfo:
    tokenizer = tokenizer_info(h)  # first: it checks the types of every key used here
    kv = h.kv
    arch = kv.get("general.architecture")
    label = kv.get("general.size_label")
    n_params = h.n_params
    if not label:
        from gguf.utility import model_weight_count_rounded_notation

        label = model_weight_count_rounded_notation(n_params) if n_params else "?"
    return ModelInfo(
        path=h.path, file_size=h.file_size, architecture=arch, name=kv.get("general.name"),
        size_label=label, n_params=n_params, file_type=file_type(h),
        context_length=kv.get(f"{arch}.context_length") if arch else None,
        n_tensors=len(h.tensors),
        tensor_types=dict(Counter(t.type for t in h.tensors).most_common()),
        tokenizer=tokenizer,
    )


def file_type(h: Header) -> str | None:
    """llama.cpp's file type name (general.file_type), else the type holding most bytes."""
    ft = h.kv.get("general.file_type")
    LlamaFileType = gguf_constants().LlamaFileType  # noqa: N806 - gguf's class

    if ft in LlamaFileType._value2member_map_ and ft != LlamaFileType.GUESSED:
        return LlamaFileType(ft).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    by_bytes = Counter()
    for t in h.tensors:
        by_bytes[t.type] += max(t.n_bytes, 0)
    return by_bytes.most_common(1)[0][0] if by_bytes else None


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# llama.cpp's vocabulary types and the defaults llama-vocab.cpp uses when a key is absent
_VOCAB_TYPE = {"llama": "spm", "bert": "wpm", "gpt2": "bpe", "hybriddna": "bpe",
               "whitespace": "bpe", "gemma4": "bpe", "t5": "ugm", "rwkv": "rwkv",
               "plamo2": "plamo2", "none": "none", "no_vocab": "none"}
_BPE_ADD_BOS_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                    "midm-2.0", "lfm2", "jina-v5-nano", "tekken", "chameleon"}


def vocab_type(model: str | None) -> str | None:
    return _VOCAB_TYPE.get(model or "", model)


def _defaults(model: str | None, pre: str | None) -> tuple[int | None, int | None, bool, bool]:
    """(bos id, eos id, add BOS, add EOS) before the file's own keys override them."""
    t = vocab_type(model)
    if model == "gemma4":
        return None, None, False, False
    if t == "spm":
        return 1, 2, True, False
    if t == "wpm":
        return 101, None, True, False
    if t == "bpe":
        bos = None if pre in ("chatglm-bpe", "glm4", "glm5") else 11
        return bos, 11, pre in _BPE_ADD_BOS_PRE, False
    if t == "ugm":
        return None, 1, False, True
    if t == "plamo2":
        return 1, 2, False, False
    return None, None, False, False


def rules(target: TokenizerInfo, draft: TokenizerInfo) -> list[tuple[str, bool, str]]:
    """llama.cpp's five compatibility rules, in its order: (rule, holds, what was found)."""
    t, d = target, draft
    missing = [name for name, x in (("target", t), ("draft", d)) if not x.model]
    out = [
        ("vocab-type", not missing and vocab_type(t.model) == vocab_type(d.model),
         f"no tokenizer in the {' and '.join(missing)} (tokenizer.ggml.model is missing)"
         if missing else f"vocab types differ: target {t.model}, draft {d.model}"),
        ("bos", t.add_bos == d.add_bos and (not t.add_bos or t.bos_id == d.bos_id),
         f"BOS differs: target add={t.add_bos} id={t.bos_id}, "
         f"draft add={d.add_bos} id={d.bos_id}"),
        ("eos", t.add_eos == d.add_eos and (not t.add_eos or t.eos_id == d.eos_id),
         f"EOS differs: target add={t.add_eos} id={t.eos_id}, "
         f"draft add={d.add_eos} id={d.eos_id}"),
    ]
    diff = abs(t.n_vocab - d.n_vocab)
    out.append(("vocab-size", diff <= VOCAB_MAX_SIZE_DIFFERENCE,
                f"vocab sizes differ by {diff} (more than {VOCAB_MAX_SIZE_DIFFERENCE}): "
                f"target {t.n_vocab}, draft {d.n_vocab}"))
    i = first_token_difference(t, d)
    out.append(("token-text", i is None, "" if i is None else
                f"token {i} differs: target {t.tokens[i]!r}, draft {d.tokens[i]!r}"))
    return out


def first_token_difference(t: TokenizerInfo, d: TokenizerInfo) -> int | None:
    """The first id from 5 to the smaller vocabulary whose text differs, or None."""
    if t.tokens_sha256 is not None and t.tokens_sha256 == d.tokens_sha256:
        return None
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(t.n_vocab, d.n_vocab)):
        if t.tokens[i] != d.tokens[i]:
            return i
    return None


def check_pair(target: TokenizerInfo, draft: TokenizerInfo) -> Verdict:
    """llama.cpp's compatibility rules, in its order; the first failure is the verdict."""
    for rule, holds, message in rules(target, draft):
        if not holds:
            return Verdict(False, rule, message)
    return Verdict(True)


def ensure_compatible(target: str | TokenizerInfo, draft: str | TokenizerInfo) -> None:
    """Raise IncompatiblePairError (exit 1) naming the failed rule, or return quietly."""
    if isinstance(target, str):
        target = read_tokenizer(target)
    verdict = check_pair(target, read_tokenizer(draft) if isinstance(draft, str) else draft)
    if not verdict.ok:
        raise IncompatiblePairError(
            f"incompatible draft/target pair ({verdict.rule}): {verdict.message}",
            rule=verdict.rule or "",
            hint="use a draft of the target's family, or --spec-type draft-translate to draft "
                 "through text",
        )


# -- the full comparison `specli check-pair` prints ----------------------------------------

@dataclass(frozen=True)
class Row:
    """One compared field: display values and a status: ok, fail, warn, or info (no rule)."""

    field: str
    target: str
    draft: str
    status: str = "info"
    note: str = ""


@dataclass(frozen=True)
class PairReport:
    target: ModelInfo
    draft: ModelInfo
    verdict: Verdict
    rows: tuple[Row, ...]
    param_ratio: float | None  # draft parameters / target parameters
    byte_ratio: float | None  # draft file size / target file size

    @property
    def warnings(self) -> list[str]:
        return [f"{r.field}: {r.note}" for r in self.rows if r.status == "warn"]

    def to_dict(self) -> dict:
        return {
            "compatible": self.verdict.ok,
            "rule": self.verdict.rule,
            "message": self.verdict.message,
            "warnings": self.warnings,
            "param_ratio": self.param_ratio,
            "byte_ratio": self.byte_ratio,
            "checks": [asdict(r) for r in self.rows],
            "target": self.target.to_dict(),
            "draft": self.draft.to_dict(),
        }


def compare(target: ModelInfo, draft: ModelInfo) -> PairReport:
    """Every field side by side: llama.cpp's rules (ok / fail) and the warnings that do not
    fail. The verdict is check_pair's."""
    t, d = target.tokenizer, draft.tokenizer
    held = {rule: (ok, msg) for rule, ok, msg in rules(t, d)}

    def rule_row(name: str, rule: str, tv: str, dv: str, why: str = "") -> Row:
        ok, msg = held[rule]
        return Row(name, tv, dv, "ok" if ok else "fail", why if ok else msg)

    def special_note(which: str, tid, did, added) -> str:
        """Why different ids still pass: llama.cpp compares them only when they are added."""
        if tid == did or added:
            return ""
        return (f"ids differ but {which} is not added to prompts, so llama.cpp does not "
                "compare them")

    def same(name: str, tv, dv, differ: str, show=str) -> Row:
        ok = tv == dv
        return Row(name, show(tv), show(dv), "ok" if ok else "warn", "" if ok else differ)

    param_ratio = draft.n_params / target.n_params if target.n_params else None
    byte_ratio = draft.file_size / target.file_size if target.file_size else None
    same_text, differs = held["token-text"]  # rules() walked the token lists already
    tok_note = differs if not same_text else (
        "identical" if t.tokens_sha256 == d.tokens_sha256 else
        f"ids {VOCAB_CHECK_START_TOKEN_ID}..{min(t.n_vocab, d.n_vocab) - 1} identical")
    rows = (
        _arch_row(target.architecture, draft.architecture),
        _size_row(target, draft, param_ratio, byte_ratio),
        Row("file type", target.file_type or "?", draft.file_type or "?"),
        Row("file size", size_text(target.file_size), size_text(draft.file_size)),
        Row("context length", _opt(target.context_length), _opt(draft.context_length)),
        rule_row("tokenizer", "vocab-type", _vocab(t.model), _vocab(d.model)),
        same("pre-tokenizer", t.pre, d.pre, "different pre-tokenizers split text "
             "differently: expect lower acceptance", _opt),
        rule_row("vocab size", "vocab-size", str(t.n_vocab), str(d.n_vocab)),
        rule_row("BOS", "bos", _special(t.bos_id, t.add_bos), _special(d.bos_id, d.add_bos),
                 special_note("BOS", t.bos_id, d.bos_id, t.add_bos)),
        rule_row("EOS", "eos", _special(t.eos_id, t.add_eos), _special(d.eos_id, d.add_eos),
                 special_note("EOS", t.eos_id, d.eos_id, t.add_eos)),
        Row("EOT", _opt(t.eot_id), _opt(d.eot_id)),
        Row("PAD", _opt(t.pad_id), _opt(d.pad_id)),
        Row("tokens", _short(t.tokens_sha256), _short(d.tokens_sha256),
            "ok" if same_text else "fail", tok_note),
        _merges_row(t, d),
        same("chat template", _short(_sha(t.chat_template)) if t.chat_template else None,
             _short(_sha(d.chat_template)) if d.chat_template else None,
             "the chat templates differ: the draft was tuned to another chat format, so "
             "acceptance on chat prompts may be lower", _template),
    )
    return PairReport(target, draft, check_pair(t, d), rows, param_ratio, byte_ratio)


def family(arch: str | None) -> str | None:
    """An architecture's family: qwen2, qwen3 and qwen3moe are all qwen."""
    return re.sub(r"(\d+(\.\d+)?)?(moe)?$", "", arch) or arch if arch else arch


def _arch_row(t: str | None, d: str | None) -> Row:
    if t == d:
        return Row("architecture", _opt(t), _opt(d), "ok")
    if d in HEAD_ARCHS:  # a draft head's architecture is its own, not a family
        return Row("architecture", _opt(t), _opt(d), "info", "a draft head's own")
    if family(t) == family(d):
        return Row("architecture", _opt(t), _opt(d), "warn",
                   f"same family ({family(t)}), different architecture: acceptance may be lower")
    return Row("architecture", _opt(t), _opt(d), "warn",
               "different architecture families: a same-family draft predicts the target "
               "better")


def _size_row(t: ModelInfo, d: ModelInfo, ratio: float | None, byte_ratio: float | None) -> Row:
    tv, dv = f"{t.size_label} ({_params(t.n_params)})", f"{d.size_label} ({_params(d.n_params)})"
    if ratio is None:
        return Row("parameters", tv, dv, "info", "no tensors to count")
    size = f"the draft has {ratio:.0%} of the target's parameters"
    if byte_ratio is not None:
        size += f" and {byte_ratio:.0%} of its file size"
    if ratio > DRAFT_RATIO_MAX:
        return Row("parameters", tv, dv, "warn", f"{size}; the rule of thumb is a draft of "
                   f"{DRAFT_RATIO_IDEAL:.0%}-{DRAFT_RATIO_MAX:.0%} of the target: a draft this "
                   "large rarely pays off")
    return Row("parameters", tv, dv, "ok", size)


def _merges_row(t: TokenizerInfo, d: TokenizerInfo) -> Row:
    tv = f"{t.n_merges} ({_short(t.merges_sha256)})" if t.merges_sha256 else "none"
    dv = f"{d.n_merges} ({_short(d.merges_sha256)})" if d.merges_sha256 else "none"
    if t.merges_sha256 == d.merges_sha256:
        return Row("merges", tv, dv, "ok" if t.merges_sha256 else "info")
    return Row("merges", tv, dv, "warn", "the BPE merges differ: the same text may tokenize "
               "differently, lowering acceptance")


def _vocab(model: str | None) -> str:
    return f"{model} ({vocab_type(model)})" if model else "none"


def _special(token: int | None, add: bool | None) -> str:
    return f"{_opt(token)}, {'added' if add else 'not added'}"


def _opt(v) -> str:
    return "-" if v is None else str(v)


def _short(digest: str | None) -> str:
    return digest[:12] if digest else "-"


def _template(v) -> str:
    return f"sha256 {v}" if v else "none"


def size_text(n: int) -> str:
    """A byte count as MiB (or GiB from 1 GiB)."""
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
