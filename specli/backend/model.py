"""GGUF models on llama-cpp-python's low-level ctypes API.

`Model` is one GGUF with one context and one sequence. It remembers which tokens its KV cache
holds (`tokens`), decodes new ones at the next positions, returns zero-copy numpy views of only
the logits rows asked for, and rewinds. Each model accumulates the wall time spent inside
llama_decode, so the engine can split draft from target time without llama_perf_context (which
bills two interleaved contexts' work to whichever reads logits first).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple, Protocol

import numpy as np

from specli import rpc
from specli.backend import ext
from specli.backend._lib import ll, set_verbose
from specli.backend.devices import kv_type, local_gpu, placement
from specli.backend.files import check_gguf
from specli.backend.samplers import Dry, Grammar
from specli.config import ModelParams, usable_cpus
from specli.errors import BackendError, ContextOverflowError, ModelFileError, UsageError
from specli.threads import Threads, candidates

_FLASH_ATTN = {
    "auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": ll.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}

def _tokenize(vocab, text: str | bytes, add_special: bool, parse_special: bool) -> list[int]:
    try:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: from JSON's "\ud800" or argv bytes
        raise UsageError(f"the text is not valid Unicode: a lone surrogate "
                         f"(U+{ord(text[e.start]):04X}) at character {e.start}") from None
    n_max = len(data) + 16
    buf = (ll.llama_token * n_max)()
    n = ll.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
    if n < 0:
        n_max = -n
        buf = (ll.llama_token * n_max)()
        n = ll.llama_tokenize(vocab, data, len(data), buf, n_max, add_special,
                              parse_special)
    return list(buf[:n])


class Tokenizer:
    """A model's vocabulary alone (no weights, no context): for tokenizing corpora."""

    def __init__(self, path: str, verbose: bool = False):
        check_gguf(path)
        set_verbose(verbose)
        mp = ll.llama_model_default_params()
        mp.vocab_only = True
        self._model = ll.llama_model_load_from_file(path.encode(), mp)
        if not self._model:
            raise ModelFileError(f"llama.cpp could not read the vocabulary of {path}",
                                 hint="rerun with -v")
        self.vocab = ll.llama_model_get_vocab(self._model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        return _tokenize(self.vocab, text, add_special, parse_special)

    def close(self) -> None:
        if getattr(self, "_model", None):
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        self.close()


class Ran(NamedTuple):
    """A decode's outcome: its logits rows, their hidden states (when kept), the seconds
    inside llama_decode and the llama_decode calls; what a draft head reads of it (when
    exported): each exported layer's input and the next-token-head states, a row per token."""

    rows: np.ndarray
    hidden: np.ndarray | None
    seconds: float
    calls: int
    layers: dict[int, np.ndarray] | None = None
    nextn: np.ndarray | None = None


class Runner(Protocol):
    """Where a Model's decodes and cache edits run: its own context (the Model itself: at
    once, on the caller's thread), or a sequence of a shared one (batching.SharedContext:
    batched with the other slots' decodes, edits between them)."""

    def run(self, m: Model, tokens: Sequence[int], pos0: int, n_out: int,
            nodes: tuple[list[int], list[list[int]]] | None = None) -> Ran:
        """m's tokens from position pos0 (or a tree's nodes: their positions and absolute
        sequence ids), the last n_out rows kept."""

    def editing(self) -> AbstractContextManager[bool]:
        """Around an edit of the cache: between decodes; False once the context is gone
        (only the bookkeeping changes then)."""

    def keep_hidden(self, m: Model, on: bool) -> None:
        """Whether m's decodes keep their hidden states."""

    def keep_exports(self, m: Model, layers: tuple[int, ...], nextn: bool) -> None:
        """What m's decodes export for a draft head (layer inputs, next-token-head states)."""



def load_weights(params: ModelParams, what: str = "") -> tuple[object, list]:
    """llama.cpp's model from params.path, placed as params say (-ngl, -dev, -sm, -ts, -mg,
    -ot, --rpc) with its multi-token-prediction layers when params.mtp: (the handle, the
    arrays whose pointers llama.cpp keeps). For a Model and a draft head's file alike; `what`
    names the file in the error ("the draft head ")."""
    check_gguf(params.path)
    set_verbose(params.verbose)
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = params.n_gpu_layers
    mp.load_mtp = params.mtp  # its multi-token-prediction layers too (draft-mtp)
    if not params.use_mmap or params.use_mlock:  # --no-mmap, --mlock: llama.cpp's load mode
        mp.load_mode = (ll.LLAMA_LOAD_MODE_MMAP_MLOCK if params.use_mmap else
                        ll.LLAMA_LOAD_MODE_MLOCK if params.use_mlock else
                        ll.LLAMA_LOAD_MODE_NONE)
    keep = placement(mp, params)
    handle = ll.llama_model_load_from_file(params.path.encode(), mp)
    if not handle:
        placed = (params.devices is not None or params.tensor_overrides
                  or params.split_mode != "layer" or params.main_gpu or params.tensor_split)
        raise ModelFileError(f"llama.cpp could not load {what}{params.path} (damaged or "
                             "truncated GGUF, an unsupported architecture" +
                             (", or a placement it refused: -dev/-sm/-ts/-mg/-ot"
                              if placed else "") + ")", hint="rerun with -v")
    return handle, keep

class Model:
    """One GGUF model, one context, one sequence. A context may hold n_seq_max sequences (a
    server's slots, batching.SharedContext): `share` makes a Model for sequence `seq` of
    another Model's context, with its own tokens and timings, that frees nothing on close;
    its decodes and edits go through `runner`, n_branch draft-tree branches and n_ctx
    cells its own."""

    def __init__(self, params: ModelParams, n_seq_max: int = 1, *, share: Model | None = None,
                 seq: int = 0, tree: bool = False, runner: Runner | None = None,
                 n_branch: int = 1, n_ctx: int | None = None):
        self.params, self.seq = params, seq  # the sequence id this model's tokens live in
        # tree: n_seq_max sequences over one unified cache of n_ctx cells, the branches of a
        # draft tree (branch 0 holds the committed tokens; decode_tree, keep)
        self.n_branch = n_seq_max if tree else n_branch
        self.tokens: list[int] = []  # what the KV cache holds, position i = tokens[i]
        self.t_decode_s = 0.0  # wall time inside llama_decode (and the wait for the device)
        self.n_decode_calls = 0
        self.n_decode_tokens = 0
        self._local = threading.local()
        self._owner = share is None
        self._runner: Runner = runner or self
        self._hidden: np.ndarray | None = None  # the last decode's, when kept
        self._keeps_hidden = False
        self._exports: tuple[tuple[int, ...], bool] = ((), False)  # read of this context
        self._exporting: set[int] = set()  # the layers llama.cpp exports (keep_exports)
        self._layers: dict[int, np.ndarray] | None = None  # the last decode's, when exported
        self._nextn: np.ndarray | None = None
        if share is not None:
            self._model, self._ctx, self.vocab, self._mem = (share._model, share._ctx,
                                                              share.vocab, share._mem)
            self._batch = None  # its decodes go through whoever owns the context
            self._threads = share._threads
            self.load_ms, self.offloaded = share.load_ms, share.offloaded
            self.n_vocab, self.n_batch = share.n_vocab, share.n_batch
            self.n_ctx = n_ctx or share.n_ctx_seq
            self.n_embd = share.n_embd
            return
        t0 = time.perf_counter()
        self._model, self._keep = load_weights(params)
        cp = ll.llama_context_default_params()
        cp.n_ctx = params.n_ctx
        cp.n_batch = params.n_batch
        cp.n_ubatch = min(params.n_ubatch, params.n_batch)
        cp.n_seq_max = n_seq_max  # > 1: a SharedContext's sequences, n_ctx / n_seq_max each
        cp.kv_unified = tree  # a tree's branches share cells and the whole context
        counts = candidates(usable_cpus())
        cp.n_threads = params.n_threads or counts[-1]
        cp.n_threads_batch = params.n_threads_batch or cp.n_threads
        cp.flash_attn_type = _FLASH_ATTN[params.flash_attn]
        if params.type_k:
            cp.type_k = kv_type(params.type_k)
        if params.type_v:
            cp.type_v = kv_type(params.type_v)
        self._ctx = ll.llama_init_from_model(self._model, cp)
        if not self._ctx:
            ll.llama_model_free(self._model)
            self._model = None
            raise BackendError(f"llama.cpp could not create a context for {params.path}",
                               hint="try a smaller -c or another KV cache type; rerun with -v")
        self.load_ms = 1e3 * (time.perf_counter() - t0)
        self.vocab = ll.llama_model_get_vocab(self._model)
        self._mem = ll.llama_get_memory(self._ctx)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.n_layer = ll.llama_model_n_layer(self._model)
        self.n_embd = ll.llama_model_n_embd(self._model)
        self.n_ctx = ll.llama_n_ctx(self._ctx)
        self.n_batch = ll.llama_n_batch(self._ctx)  # llama.cpp caps n_batch at n_ctx
        # layers on a GPU: there each distinct batch shape costs a CUDA graph capture
        self.offloaded = (local_gpu() and params.n_gpu_layers != 0
                          and params.devices != ())
        self._batch = ll.llama_batch_init(self.n_batch, 0, n_seq_max if tree else 1)
        # -t auto: the counts measured at its decodes (an explicit -t stays as given)
        self._threads = None if params.n_threads is not None else Threads(
            counts, lambda n, nb: ll.llama_set_n_threads(self._ctx, n, nb),
            params.n_threads_batch)
        if params.warmup:
            self._warm_up()
            self.load_ms = 1e3 * (time.perf_counter() - t0)
        if params.rpc:  # its connections to the workers are open now: notice a vanished one
            rpc.keepalive(params.rpc)

    def _warm_up(self) -> None:
        """llama.cpp's warmup (common_init_from_params): BOS and EOS decoded once before
        anything is timed, then an empty cache and fresh timings. The weights are paged in,
        the compute graph allocated and a GPU's kernels loaded at load time, not in the
        first prompt's (as native llama.cpp's first token finds them)."""
        tokens = [t for t in (ll.llama_vocab_bos(self.vocab), ll.llama_vocab_eos(self.vocab))
                  if t >= 0] or [0]
        ll.llama_set_warmup(self._ctx, True)
        try:
            ll.llama_decode(self._ctx, ll.llama_batch_get_one(
                (ll.llama_token * len(tokens))(*tokens), len(tokens)))
            ll.llama_memory_clear(self._mem, True)
            ll.llama_synchronize(self._ctx)
            ll.llama_perf_context_reset(self._ctx)
        finally:
            ll.llama_set_warmup(self._ctx, False)

    # -- vocabulary -------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        return _tokenize(self.vocab, text, add_special, parse_special)

    def tokenize_bytes(self, data: bytes, add_special: bool = False,
                       parse_special: bool = False) -> list[int]:
        """UTF-8 text as bytes (what token_bytes spells), tokenized."""
        return _tokenize(self.vocab, bytes(data), add_special, parse_special)

    @property
    def eos_token(self) -> int | None:
        """The end-of-sequence token, if the vocabulary has one."""
        t = ll.llama_vocab_eos(self.vocab)
        return int(t) if t >= 0 else None

    def dry(self, sp) -> Dry:
        """llama.cpp's DRY sampler with the request's settings, over this vocabulary."""
        return Dry(self, sp)

    # where this model's grammars live: None here, in this process; a server gives each
    # slot a process of its own (grammar_host.GrammarHost.open), bounded in time and memory
    grammar_source = None

    def grammar(self, gbnf: str) -> Grammar:
        """A GBNF grammar's parse state over this vocabulary; UsageError if it is invalid."""
        if self.grammar_source is not None:
            return self.grammar_source(gbnf)
        return Grammar(self, gbnf)

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        # a buffer per thread: a server tokenizes requests while its slots' loop decodes
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = ctypes.create_string_buffer(256)
        n = ll.llama_token_to_piece(self.vocab, token, buf, 256, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
            return buf.raw[:n]
        return buf.raw[:n]

    @functools.cached_property
    def eog(self) -> tuple[int, ...]:
        """Every end-of-generation token of the vocabulary (once per model)."""
        return tuple(t for t in range(self.n_vocab) if ll.llama_vocab_is_eog(self.vocab, t))

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest text one token spells (special tokens included): n tokens never spell
        more than n times this, which bounds a prompt before it is tokenized."""
        buf = ctypes.create_string_buffer(1024)
        longest = 1
        for t in range(self.n_vocab):
            n = ll.llama_token_to_piece(self.vocab, t, buf, 1024, 0, True)
            longest = max(longest, -n if n < 0 else n)
        return longest

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self.vocab, token))

    def special_text(self, which: str) -> str:
        tok = {"bos": ll.llama_vocab_bos, "eos": ll.llama_vocab_eos}[which](self.vocab)
        return self.token_bytes(tok, special=True).decode("utf-8", "replace") if tok >= 0 else ""

    def chat_template(self) -> str | None:
        """The chat template: --chat-template's, else the file's (None if it has none)."""
        if self.params.chat_template is not None:
            return self.params.chat_template
        t = ll.llama_model_chat_template(self._model, None)
        return t.decode("utf-8") if t else None

    # -- the KV cache -----------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], logits: str | int = "last") -> np.ndarray:
        """Decode `tokens` at the next positions; return a (rows, n_vocab) view of their logits.

        logits: "last" (one row), "all" (a row per token), "none", or an int n for the last n.
        The view is only valid until the next decode on this model.
        """
        n_out = self._plan(tokens, logits)
        try:
            ran = self._runner.run(self, tokens, len(self.tokens), n_out)
        except BaseException:
            self._truncate(len(self.tokens))  # drop what a failed chunk left in the cache
            raise
        self._count(ran, len(tokens))
        self.tokens.extend(tokens)
        return ran.rows

    def _count(self, ran: Ran, n_tokens: int) -> None:
        self.t_decode_s += ran.seconds
        self.n_decode_calls += ran.calls
        self.n_decode_tokens += n_tokens
        self._hidden = ran.hidden
        self._layers, self._nextn = ran.layers, ran.nextn

    def _plan(self, tokens: Sequence[int], logits: str | int) -> int:
        """The number of logits rows a decode returns, after checking that it can run."""
        n = len(tokens)
        if n == 0:
            raise BackendError("internal: decode of zero tokens")
        if len(self.tokens) + n > self.n_ctx:
            raise ContextOverflowError(
                f"context full: {len(self.tokens) + n} tokens do not fit -c {self.n_ctx}",
                hint="raise -c/--ctx-size",
            )
        n_out = min(int({"last": 1, "all": n, "none": 0}.get(logits, logits)), n)
        if n_out > (n - 1) % self.n_batch + 1:  # llama.cpp keeps only the last chunk's rows
            raise BackendError(f"internal: {n_out} logits rows asked of a {n}-token decode "
                               f"larger than n_batch {self.n_batch}")
        return n_out

    def decode_chunked(self, tokens: Sequence[int], pos0: int, seq: int,
                        n_out: int) -> tuple[float, int]:
        """One sequence's tokens in chunks of n_batch; only the last chunk asks for rows.
        Returns (seconds inside llama_decode, decode calls)."""
        n, secs, calls, start = len(tokens), 0.0, 0, 0
        while start < n:
            end = min(start + self.n_batch, n)
            secs += self.decode_segments([(tokens[start:end], pos0 + start, seq,
                                            n_out if end == n else 0)])
            calls += 1
            start = end
        return secs, calls

    def decode_segments(self, segments: Sequence[tuple[Sequence[int], int, int, int]]) -> float:
        """One llama_decode of (tokens, first position, sequence, rows wanted) segments that
        fit one batch together; the rows come back in segment order. Returns the seconds."""
        return self.decode_items([(t, pos0 + i, (seq,), i >= len(tokens) - n_out)
                                  for tokens, pos0, seq, n_out in segments
                                  for i, t in enumerate(tokens)])

    # -- draft trees: branches in sequences seq..seq+n_seq_max-1 of a unified cache ----------
    # (branch ids are relative to the model's own sequence; branch 0 holds what is committed)
    def branch(self, seqs: Sequence[int]) -> None:
        """Each of the branches `seqs` but 0 starts as a copy of the committed tokens (no
        data moves: in a unified cache a copy tags the same cells)."""
        for s in seqs:
            if s != 0:
                self.fork(0, s)

    def fork(self, src: int, dst: int) -> None:
        """Branch dst becomes a copy of branch src."""
        with self._runner.editing() as live:
            if not live:
                raise BackendError("the model's context is closed (the server is stopping)")
            ll.llama_memory_seq_rm(self._mem, self.seq + dst, -1, -1)
            ll.llama_memory_seq_cp(self._mem, self.seq + src, self.seq + dst, -1, -1)

    def decode_tree(self, tokens: Sequence[int], pos: Sequence[int],
                    seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """One llama_decode of tree nodes: token i at position pos[i], in every branch of
        seqs[i] (the branches that pass through it), a logits row each. Nodes come parents
        first; `tokens` (branch 0's) is unchanged until `keep`."""
        n = self._check_tree(tokens, pos)
        ran = self._runner.run(self, tokens, pos[0], n,
                               (list(pos), [[self.seq + s for s in ss] for ss in seqs]))
        self._count(ran, n)
        return ran.rows

    def _check_tree(self, tokens: Sequence[int], pos: Sequence[int]) -> int:
        """The number of nodes, after checking that one batch and the context take them."""
        n = len(tokens)
        if not 0 < n <= self.n_batch:
            raise BackendError(f"internal: a tree of {n} nodes (n_batch {self.n_batch})")
        if max(pos) >= self.n_ctx:
            raise ContextOverflowError(f"context full: position {max(pos)} does not fit "
                                       f"-c {self.n_ctx}", hint="raise -c/--ctx-size")
        return n

    def decode_items(self, items: Sequence[tuple[int, int, Sequence[int], bool]]) -> float:
        """One llama_decode of (token, position, sequences, wants logits) items. Returns the
        seconds it took."""
        b = self._batch
        for j, (t, p, ss, out) in enumerate(items):
            b.token[j], b.pos[j], b.logits[j], b.n_seq_id[j] = t, p, int(out), len(ss)
            for i, s in enumerate(ss):
                b.seq_id[j][i] = s
        b.n_tokens = n = len(items)
        if self._threads is not None:
            self._threads.before(n)
        t0 = time.perf_counter()
        rc = ll.llama_decode(self._ctx, b)
        if rc != 0:
            raise BackendError(f"llama_decode failed with code {rc}", hint="rerun with -v")
        ll.llama_synchronize(self._ctx)  # a GPU returns early: wait, or reading pays for it
        seconds = time.perf_counter() - t0
        if self._threads is not None:
            self._threads.after(n, seconds)
        return seconds

    @property
    def threads(self) -> str:
        """Its thread counts, for the statistics: -t auto's choice and why, or as given."""
        if self._threads is not None:
            return self._threads.describe()
        p = self.params
        return f"{p.n_threads}" + (f", {p.n_threads_batch} for batches"
                                   if p.n_threads_batch not in (None, p.n_threads) else "")

    def keep(self, seq: int, tokens: Sequence[int]) -> None:
        """Branch `seq` up to len(tokens) becomes the committed branch 0, holding `tokens`
        (its cells, which the caller knows spell them); every other branch and every cell
        past them is dropped. Other models' sequences of a shared context are untouched."""
        n, base = len(tokens), self.seq
        with self._runner.editing() as live:
            if live:
                ll.llama_memory_seq_rm(self._mem, base + seq, n, -1)
                if seq != 0:
                    ll.llama_memory_seq_rm(self._mem, base, -1, -1)
                    ll.llama_memory_seq_cp(self._mem, base + seq, base, -1, -1)
                for s in range(1, self.n_branch):
                    ll.llama_memory_seq_rm(self._mem, base + s, -1, -1)
            self.tokens[:] = tokens

    def shares(self, other: object) -> bool:
        """Whether adopt(other) can copy other's sequence into this one."""
        return (isinstance(other, Model) and other._mem is self._mem and other is not self
                and self.n_branch == 1 and other.n_branch == 1)

    def adopt(self, other: Model) -> bool:
        """This sequence becomes a copy of other's, a sequence of the same context: its
        cells and its tokens (a server moving a cached prompt to another slot). With a cache
        stream a sequence llama.cpp copies the stream's buffers at its next decode, before
        that decode writes anything. False, and nothing changed, where the two do not share
        a context, or either holds draft-tree branches."""
        if not self.shares(other):
            return False
        with self._runner.editing() as live:
            if not live:
                return False
            ll.llama_memory_seq_rm(self._mem, self.seq, -1, -1)
            ll.llama_memory_seq_cp(self._mem, other.seq, self.seq, -1, -1)
            self.tokens[:] = other.tokens
        return True

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        """The lowest and highest position branch `seq` holds ((-1, -1) when empty)."""
        with self._runner.editing():
            return (int(ll.llama_memory_seq_pos_min(self._mem, self.seq + seq)),
                    int(ll.llama_memory_seq_pos_max(self._mem, self.seq + seq)))

    @property
    def n_ctx_seq(self) -> int:
        """The context each of its sequences gets (n_ctx / n_seq_max)."""
        return int(ll.llama_n_ctx_seq(self._ctx))

    def rows(self, n_out: int) -> np.ndarray:
        """A zero-copy view of the last decode's n_out logits rows."""
        if n_out == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        ptr = ll.llama_get_logits(self._ctx)
        if not ptr:
            raise BackendError("internal: no logits for the last decode")
        # building a view costs as much as a GPU-side argmax (every draft token pays it):
        # ext.view keeps one per address and shape
        return ext.view(ctypes.addressof(ptr.contents), (n_out, self.n_vocab))

    def rewind(self, n_keep: int) -> None:
        """Drop every cached token from position n_keep on."""
        if n_keep < len(self.tokens):
            self._truncate(n_keep)

    def _truncate(self, n_keep: int) -> None:
        with self._runner.editing() as live:
            if live and not ll.llama_memory_seq_rm(self._mem, self.seq, n_keep, -1):
                # partial removal refused (recurrent models): start over rather than lie
                ll.llama_memory_seq_rm(self._mem, self.seq, -1, -1)
                self.tokens.clear()
                raise BackendError("this model's cache cannot be rolled back partially",
                                   hint="speculative decoding needs a transformer KV cache")
            del self.tokens[n_keep:]

    def shift(self, n_keep: int, n_discard: int) -> bool:
        """llama.cpp's context shift: drop the cached tokens at n_keep .. n_keep + n_discard
        - 1 and move the later ones back by n_discard (llama.cpp rotates their keys at the
        next decode). False, and nothing changed, where the cache cannot shift."""
        with self._runner.editing() as live:
            if live:
                if not ll.llama_memory_can_shift(self._mem) or not ll.llama_memory_seq_rm(
                        self._mem, self.seq, n_keep, n_keep + n_discard):
                    return False
                ll.llama_memory_seq_add(self._mem, self.seq, n_keep + n_discard, -1,
                                        -n_discard)
            del self.tokens[n_keep:n_keep + n_discard]
        return True

    def kv_pos_max(self) -> int:
        """The highest position llama.cpp holds for the sequence (-1 when empty)."""
        with self._runner.editing() as live:
            return int(ll.llama_memory_seq_pos_max(self._mem, self.seq)) if live else -1

    def sync(self, tokens: Sequence[int],
             on_progress: Callable[[int, int], None] | None = None,
             span: int | None = None, each: Callable[[Sequence[int], int], None] | None = None,
             outputs: bool = False) -> int:
        """Make the cache hold exactly `tokens`, reusing the common prefix, a batch of n_batch
        at a time. on_progress(reused, processed) is called before and after each batch, the
        batches cut as if `span` tokens were evaluated (the caller decodes the rest right
        after); each(batch, first position) after each batch is decoded. outputs: every token
        gets an output row (its logits, and its hidden state when set_hidden), else none.

        Returns how many tokens were reused."""
        n = 0
        limit = min(len(self.tokens), len(tokens))
        while n < limit and self.tokens[n] == tokens[n]:
            n += 1
        self.rewind(n)
        if len(tokens) > self.n_ctx:  # refused whole, before any batch is decoded
            raise ContextOverflowError(f"context full: {len(tokens)} tokens do not fit "
                                       f"-c {self.n_ctx}", hint="raise -c/--ctx-size")
        if on_progress is not None:
            on_progress(n, n)
        total = max(span or 0, len(tokens)) if on_progress is not None else len(tokens)
        for start in range(n, total, self.n_batch):
            end = min(start + self.n_batch, total)
            batch = tokens[start:min(end, len(tokens))]
            if batch:
                self.decode(batch, logits="all" if outputs else "none")
                if each is not None:
                    each(batch, start)
            if on_progress is not None:
                on_progress(n, end)
        return n

    # -- what a draft reads of the target's decodes -----------------------------------------
    def set_hidden(self, on: bool) -> None:
        """Whether decodes also keep the last hidden state of each output row (hidden())."""
        self._runner.keep_hidden(self, on)

    def hidden(self, n_out: int) -> np.ndarray:
        """The last decode's n_out hidden states (n_out, n_embd), valid until the next decode;
        the decode must have run with set_hidden(True)."""
        if self._hidden is None:
            raise BackendError("internal: hidden states read from a decode that kept none")
        return self._hidden[:n_out]

    # -- what a draft head reads of the target's decodes (backend/heads.py) -------------------
    @property
    def llama_handles(self) -> tuple[object, object]:
        """(llama_model, llama_context): for a head's context beside this one."""
        return self._model, self._ctx

    @property
    def n_nextn(self) -> int:
        """The multi-token-prediction layers loaded with the model (draft-mtp's heads)."""
        return int(ext.fn("llama_model_n_layer_nextn")(self._model)) if self.params.mtp else 0

    def export(self, layers: Sequence[int] = (), nextn: bool = False, on: bool = True) -> None:
        """Decodes keep (on) or stop keeping the input of these layers and the state the
        next-token heads take, for every token decoded (layer_rows, nextn_rows)."""
        self._runner.keep_exports(self, tuple(layers) if on else (), nextn and on)

    def layer_rows(self, layers: Sequence[int], n_tokens: int) -> np.ndarray:
        """The last decode's inputs of `layers`, a row per token decoded: (n_tokens,
        len(layers) * n_embd), the layers side by side (the features a head's encoder takes)."""
        if self._layers is None or any(lid not in self._layers for lid in layers):
            raise BackendError("internal: layer inputs read from a decode that kept none")
        return np.concatenate([self._layers[lid][-n_tokens:] for lid in layers], axis=1)

    def nextn_rows(self, n_tokens: int) -> np.ndarray:
        """The last decode's next-token-head states, a row per token decoded."""
        if self._nextn is None:
            raise BackendError("internal: head states read from a decode that kept none")
        return self._nextn[-n_tokens:]

    def read_exports(self, n_tokens: int, layers: Sequence[int],
                     nextn: bool) -> tuple[dict[int, np.ndarray] | None, np.ndarray | None]:
        """Copies of what this context's last decode of n_tokens exported."""
        shape = (n_tokens, self.n_embd)
        out = {lid: ext.rows("llama_get_embeddings_layer_inp", self._ctx, lid, shape=shape)
               for lid in layers} if layers else None
        return out, (ext.rows("llama_get_embeddings_nextn", self._ctx, shape=shape)
                     if nextn else None)

    # -- Runner, for its own context: decodes at once, on the caller's thread -----------------
    def run(self, m: Model, tokens: Sequence[int], pos0: int, n_out: int,
            nodes: tuple[list[int], list[list[int]]] | None = None) -> Ran:
        if nodes is None:
            secs, calls = self.decode_chunked(tokens, pos0, m.seq, n_out)
        else:
            secs, calls = self.decode_items(
                [(t, p, ss, True) for t, p, ss in zip(tokens, *nodes, strict=True)]), 1
        layers, nextn = self._exports
        exported = (self.read_exports(min(len(tokens), self.n_batch), layers, nextn)
                    if layers or nextn else (None, None))
        return Ran(self.rows(n_out), self.hidden_rows(n_out) if self._keeps_hidden else None,
                   secs, calls, *exported)

    def editing(self) -> AbstractContextManager[bool]:
        return nullcontext(True)

    def keep_hidden(self, m: Model, on: bool) -> None:
        self._keeps_hidden = on
        ll.llama_set_embeddings(self._ctx, on)

    def keep_exports(self, m: Model, layers: tuple[int, ...], nextn: bool) -> None:
        """This context's decodes export these layers' inputs (and the next-token-head
        states if nextn) and `run` reads them, for every token it decodes.

        A layer once exported stays exported until the context closes, read or not, as
        llama.cpp's own speculative contexts set it once: each change of that set makes
        llama.cpp reserve its compute graphs again at the next decode (2-3 ms on the tiny
        heads of the tests, more on a large model): every generation of an EAGLE-3 or
        DFlash head paid one when the one before had turned the export off at its end. The
        next-token-head states cost no reserve and are turned off."""
        old_nextn = self._exports[1]
        for lid in set(layers) - self._exporting:
            ext.fn("llama_set_embeddings_layer_inp")(self._ctx, lid, True)
            self._exporting.add(lid)
        if nextn != old_nextn:
            ext.fn("llama_set_embeddings_nextn")(self._ctx, nextn, False)
        self._exports = (tuple(layers), nextn)

    def hidden_rows(self, n_out: int) -> np.ndarray:
        """A view of the last decode's n_out hidden states, on the context that ran it."""
        ptr = ll.llama_get_embeddings(self._ctx)
        if not ptr:
            raise BackendError("internal: hidden states read from a decode that kept none")
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_embd))

    def close(self) -> None:
        if not getattr(self, "_owner", True):  # a sequence of another's context
            self._ctx = self._model = None
            return
        if getattr(self, "_ctx", None):
            if getattr(self, "_batch", None) is not None:
                ll.llama_batch_free(self._batch)
                self._batch = None
            ll.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        self.close()
