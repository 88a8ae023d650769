"""What the engine, the drafts and the prompts use of a model, by role (tokenizing, decoding,
tree branches, the states a draft reads): the interface that the real Model (its own
context, or a server slot's sequence of a shared one) and a test's fake share. A function
that needs one role takes that role's type, so a fake implements what it serves."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Vocabulary(Protocol):
    """Tokenizing and templates: what a prompt is made with (prompt.py)."""

    params: Any  # its ModelParams (the template settings)
    n_ctx: int
    n_vocab: int
    max_token_bytes: int

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]: ...
    def token_bytes(self, token: int, special: bool = False) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def special_text(self, which: str) -> str: ...
    def chat_template(self) -> str | None: ...
    def grammar(self, gbnf: str) -> Any: ...


@runtime_checkable
class Decoder(Protocol):
    """Decoding into the KV cache of one sequence, and what its decodes cost (meter.py)."""

    tokens: list[int]  # what its KV cache holds, position i = tokens[i]
    n_ctx: int
    n_batch: int
    load_ms: float
    offloaded: bool  # layers on a local GPU
    t_decode_s: float  # wall time inside its decodes
    n_decode_calls: int
    n_decode_tokens: int
    threads: str  # its thread counts: as given, or -t auto's choice and why

    def decode(self, tokens: Sequence[int], logits: str | int = "last") -> np.ndarray: ...
    def sync(self, tokens: Sequence[int], on_progress: Callable[[int, int], None] | None = None,
             span: int | None = None, each: Callable[[Sequence[int], int], None] | None = None,
             outputs: bool = False) -> int: ...
    def rewind(self, n_keep: int) -> None: ...
    def shift(self, n_keep: int, n_discard: int) -> bool: ...
    def kv_pos_max(self) -> int: ...
    def close(self) -> None: ...


@runtime_checkable
class Branches(Protocol):
    """Draft trees: branches beside the committed sequence, edited in the cache."""

    n_branch: int  # draft-tree branches it can hold (1: none)

    def branch(self, seqs: Sequence[int]) -> None: ...
    def fork(self, src: int, dst: int) -> None: ...
    def decode_tree(self, tokens: Sequence[int], pos: Sequence[int],
                    seqs: Sequence[Sequence[int]]) -> np.ndarray: ...
    def keep(self, seq: int, tokens: Sequence[int]) -> None: ...


@runtime_checkable
class States(Protocol):
    """What a draft reads of the target's decodes: hidden states, layer inputs, MTP state."""

    def set_hidden(self, on: bool) -> None: ...
    def hidden(self, n_out: int) -> np.ndarray: ...
    def export(self, layers: Sequence[int] = (), nextn: bool = False,
               on: bool = True) -> None: ...
    def layer_rows(self, layers: Sequence[int], n_tokens: int) -> np.ndarray: ...
    def nextn_rows(self, n_tokens: int) -> np.ndarray: ...


@runtime_checkable
class Backend(Vocabulary, Decoder, Branches, States, Protocol):
    """A whole model as the engine uses it: every role above."""
