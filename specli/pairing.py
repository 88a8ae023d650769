"""Draft/target compatibility from GGUF metadata alone (the `gguf` package, no weights loaded).

One policy, `check_pair`, used by engine load and (later) by `specli check-pair`: llama.cpp's
rules from common/speculative.cpp, so a pair specli accepts is one llama.cpp accepts too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from specli.errors import IncompatiblePairError, ModelFileError

# llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE and SPEC_VOCAB_CHECK_START_TOKEN_ID
VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


@dataclass(frozen=True)
class TokenizerInfo:
    path: str
    architecture: str | None
    model: str | None  # tokenizer.ggml.model: gpt2, llama, ...
    pre: str | None
    tokens: tuple[str, ...]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool | None
    add_eos: bool | None

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    rule: str | None = None  # the first rule that failed
    message: str = "compatible"


def read_tokenizer(path: str) -> TokenizerInfo:
    """Read the tokenizer metadata of a GGUF file; ModelFileError if it is not a readable GGUF."""
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise ModelFileError(f"model file not found: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror}") from e
    if magic != b"GGUF":
        raise ModelFileError(f"not a GGUF file: {path}", hint="specli reads llama.cpp GGUF models")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # the gguf package raises assorted errors on damaged files
        raise ModelFileError(f"damaged or truncated GGUF file: {path} ({e})") from e

    def scalar(key: str):
        field = reader.fields.get(key)
        if field is None or not field.data:
            return None
        v = field.contents()
        return v

    tokens_field = reader.fields.get("tokenizer.ggml.tokens")
    tokens = tuple(tokens_field.contents()) if tokens_field is not None else ()
    add_bos = scalar("tokenizer.ggml.add_bos_token")
    add_eos = scalar("tokenizer.ggml.add_eos_token")
    return TokenizerInfo(
        path=path,
        architecture=scalar("general.architecture"),
        model=scalar("tokenizer.ggml.model"),
        pre=scalar("tokenizer.ggml.pre"),
        tokens=tokens,
        bos_id=scalar("tokenizer.ggml.bos_token_id"),
        eos_id=scalar("tokenizer.ggml.eos_token_id"),
        add_bos=None if add_bos is None else bool(add_bos),
        add_eos=None if add_eos is None else bool(add_eos),
    )


def check_pair(target: TokenizerInfo, draft: TokenizerInfo) -> Verdict:
    """llama.cpp's compatibility rules, in its order; the first failure is the verdict."""
    if target.model != draft.model:
        return Verdict(False, "vocab-type", f"vocab types differ: target {target.model}, "
                       f"draft {draft.model}")
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos_id != draft.bos_id):
        return Verdict(False, "bos", f"BOS differs: target add={target.add_bos} "
                       f"id={target.bos_id}, draft add={draft.add_bos} id={draft.bos_id}")
    if target.add_eos != draft.add_eos or (target.add_eos and target.eos_id != draft.eos_id):
        return Verdict(False, "eos", f"EOS differs: target add={target.add_eos} "
                       f"id={target.eos_id}, draft add={draft.add_eos} id={draft.eos_id}")
    diff = abs(target.n_vocab - draft.n_vocab)
    if diff > VOCAB_MAX_SIZE_DIFFERENCE:
        return Verdict(False, "vocab-size", f"vocab sizes differ by {diff} (more than "
                       f"{VOCAB_MAX_SIZE_DIFFERENCE}): target {target.n_vocab}, "
                       f"draft {draft.n_vocab}")
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
        if target.tokens[i] != draft.tokens[i]:
            return Verdict(False, "token-text", f"token {i} differs: target {target.tokens[i]!r}, "
                           f"draft {draft.tokens[i]!r}")
    return Verdict(True)


def ensure_compatible(target_path: str, draft_path: str) -> None:
    """Raise IncompatiblePairError (exit 1) naming the failed rule, or return quietly."""
    verdict = check_pair(read_tokenizer(target_path), read_tokenizer(draft_path))
    if not verdict.ok:
        raise IncompatiblePairError(
            f"incompatible draft/target pair ({verdict.rule}): {verdict.message}",
            rule=verdict.rule or "",
            hint="the draft must share the target's tokenizer (same model family)",
        )
