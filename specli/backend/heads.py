"""The draft heads' side of llama.cpp: what the target exports for them and the context they
run in (llama.cpp's common/speculative.cpp, draft-mtp / draft-eagle3 / draft-dflash /
draft-dspark).

A head reads the target's hidden states: the input of chosen layers (EAGLE-3, DFlash) or the
state the multi-token-prediction layers take (MTP, "nextn"). llama.cpp declares those calls
in src/llama-ext.h without C linkage, and llama-cpp-python binds none of them: they are bound
here by their exported C++ names. A build without one is refused before any weights load
(`require`). The batches a head decodes carry an embedding row beside each token (or only a
row), which only llama.cpp's extended batch (llama_batch_ext, llama_process) can say.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np

from specli.backend import ext
from specli.backend._lib import ll
from specli.backend.ext import fn
from specli.backend.model import _FLASH_ATTN, Model, load_weights
from specli.config import DEFAULT_THREADS, ModelParams
from specli.errors import BackendError

_F = ctypes.POINTER(ctypes.c_float)


@functools.cache
def _batch_fns() -> tuple:
    """The extended batch's functions, looked up once (a draft token builds a batch)."""
    return tuple(fn(n) for n in (
        "llama_batch_ext_add_token", "llama_batch_ext_add_embd", "llama_batch_ext_set_pos",
        "llama_batch_ext_set_embd_token", "llama_batch_ext_set_output_logits", "llama_embd",
        "llama_batch_ext_clear", "llama_process"))


def _floats(row: np.ndarray):
    """A contiguous float32 row as the float array llama_embd takes by pointer (a ctypes
    array over its buffer, whose type ctypes caches: cheaper than ndarray.ctypes.data_as,
    which a read-only row still takes)."""
    if not row.flags.writeable:
        return row.ctypes.data_as(_F)
    return (ctypes.c_float * row.size).from_buffer(row)


def _arch(model) -> str:
    """A loaded model's general.architecture."""
    buf = ctypes.create_string_buffer(64)
    n = ll.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""


class HeadModel:
    """A draft head's own GGUF (EAGLE-3, DFlash, DSpark, or an MTP file beside its target:
    params.mtp), loaded once for every context on it (a server's slots each have one);
    closed after them."""

    def __init__(self, params: ModelParams):
        t0 = time.perf_counter()
        self.params = params
        self.handle, self._keep = load_weights(params, "the draft head ")
        self.load_ms = 1e3 * (time.perf_counter() - t0)

    def close(self) -> None:
        if getattr(self, "handle", None):
            ll.llama_model_free(self.handle)
            self.handle = None

    def __del__(self):
        self.close()


class HeadContext:
    """A draft head's context beside the target's (llama.cpp's ctx_other): on the target's
    own model with its multi-token-prediction layers (MTP), or on a head file of its own
    (EAGLE-3, DFlash, DSpark: `params`). It decodes llama.cpp's extended batches: a token
    with an embedding row (or a row alone) at a position, an output or not. It keeps the
    timings a Model keeps, for the statistics."""

    def __init__(self, target: Model, head: ModelParams | HeadModel | None = None,
                 decoder: Executor | None = None):
        """head: the head's file (loaded here, freed on close), or a HeadModel another
        owns; None: the target's own prediction layers (MTP). decoder: where the decodes run
        (a server's loop, batching.Scheduler), else on the caller's thread."""
        self.target, self.decoder = target, decoder
        self.t_decode_s = 0.0
        self.n_decode_calls = self.n_decode_tokens = 0
        self.tokens: list[int] = []  # the target's tokens the head has taken in, committed
        tp = target.params  # its context's counts (-t auto: the default, its decodes small)
        self.threads = f"{tp.n_threads or DEFAULT_THREADS}"
        self._owned = HeadModel(head) if isinstance(head, ModelParams) else None
        shared = self._owned or head
        self.params = shared.params if shared is not None else target.params
        self._own_model = shared is not None
        self._model = shared.handle if shared is not None else target.llama_handles[0]
        self.mtp = self.params.mtp  # multi-token-prediction layers: the target's or a file's
        # a Gemma 4 assistant attends over the target's own cache (llama.cpp's shared-KV MTP
        # mode): its context mirrors the target's sequences, and it decodes in this one's
        self.shares_memory = _arch(self._model) == "gemma4-assistant"
        self.seq = target.seq if self.shares_memory else 0
        t_ctx = target.llama_handles[1]
        tp = target.params
        cp = ll.llama_context_default_params()
        cp.n_ctx = ll.llama_n_ctx(t_ctx) if self.shares_memory else target.n_ctx
        cp.n_batch = target.n_batch
        cp.n_ubatch = min(tp.n_ubatch, target.n_batch)
        cp.n_threads = tp.n_threads or DEFAULT_THREADS  # (-t auto: a head's decodes are small)
        cp.n_threads_batch = tp.n_threads_batch or cp.n_threads
        cp.flash_attn_type = _FLASH_ATTN[tp.flash_attn]
        cp.n_seq_max = ll.llama_n_seq_max(t_ctx) if self.shares_memory else 1
        cp.ctx_other = t_ctx
        if self.mtp:
            cp.ctx_type = ll.LLAMA_CONTEXT_TYPE_MTP
            cp.n_outputs_max = 1  # as llama.cpp's draft context: one sequence, one row
        if self.shares_memory:
            cp.n_outputs_max = cp.n_seq_max
        self._ctx = ll.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            raise BackendError("llama.cpp could not create the draft head's context",
                               hint="rerun with -v")
        self.load_ms = self._owned.load_ms if self._owned is not None else 0.0
        self._mem = ll.llama_get_memory(self._ctx)
        self.vocab = ll.llama_model_get_vocab(self._model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.n_embd = ll.llama_model_n_embd(self._model)
        # the width of the states it reads and writes: an MTP head's are the target's (a
        # Gemma 4 assistant is narrower inside), the other heads' their own
        self.n_state = ll.llama_model_n_embd_out(self._model) if self.mtp else self.n_embd
        self.n_ctx = target.n_ctx
        self.n_batch = target.n_batch
        self.n_ubatch = int(ll.llama_n_ubatch(self._ctx))
        self._batch = fn("llama_batch_ext_init")(self._ctx)
        # a batch item's position, copied by set_pos: an embedding item of an M-RoPE head
        # (DFlash for a Qwen3.5 target) takes four, text positions as native writes them
        # ({p, p, p, 0}); any other item reads the first
        self._pos = (ll.llama_pos * 4)()

    @property
    def n_nextn(self) -> int:
        """The multi-token-prediction layers of the model it runs (MTP)."""
        return int(fn("llama_model_n_layer_nextn")(self._model)) if self.mtp else 0

    def run(self, items: Sequence[tuple[int | None, int, np.ndarray | None, bool]],
            encode: bool = False) -> None:
        """One llama_process of (token or None, position, embedding row or None, output)
        items, all in this head's sequence; encode: the head's encoder (no cache) instead."""
        add_token, add_embd, set_pos, set_embd, set_out, embd, clear, process = _batch_fns()
        b, seq, pos_cell = self._batch, self.seq, self._pos
        pos_ref = pos_cell
        clear(b)
        keep = []  # the rows' buffers, alive until llama.cpp has copied them
        for token, pos, row, out in items:
            if row is not None:
                row = np.ascontiguousarray(row, np.float32)
                keep.append(row)
                e = embd(_floats(row), 1, row.shape[-1])
            idx = add_embd(b, seq, e) if token is None else add_token(b, seq, token)
            if idx < 0:
                raise BackendError(f"internal: a head batch refused an item ({idx})")
            pos_cell[0] = pos_cell[1] = pos_cell[2] = pos
            set_pos(b, idx, pos_ref)
            if token is not None and row is not None and not set_embd(b, idx, e):
                raise BackendError("internal: a head batch refused an embedding row")
            if out:
                set_out(b, idx, True)
        t0 = time.perf_counter()
        kind = ll.LLAMA_PROCESS_TYPE_ENCODE if encode else ll.LLAMA_PROCESS_TYPE_DECODE
        rc = (process(self._ctx, kind, b) if self.decoder is None else
              self.decoder.submit(process, self._ctx, kind, b).result())
        if rc != 0:
            raise BackendError(f"the draft head's decode failed with code {rc}",
                               hint="rerun with -v")
        ll.llama_synchronize(self._ctx)
        self.t_decode_s += time.perf_counter() - t0
        self.n_decode_calls += 1
        self.n_decode_tokens += len(items)

    def logits(self, i: int) -> np.ndarray:
        """The logits row of the last decode's batch item i (a view, valid until the next
        decode)."""
        ptr = ll.llama_get_logits_ith(self._ctx, i)
        if not ptr:
            raise BackendError(f"internal: no logits for head batch item {i}")
        return ext.view(ctypes.addressof(ptr.contents), (self.n_vocab,))

    def logits_rows(self, n_rows: int) -> np.ndarray:
        """The logits rows of the last decode's first n_rows outputs (a view, valid until
        the next decode), one read for a whole block."""
        ptr = ll.llama_get_logits(self._ctx)
        if not ptr:
            raise BackendError("internal: no logits for the head's batch")
        return ext.view(ctypes.addressof(ptr.contents), (n_rows, self.n_vocab))

    def nextn(self, i: int) -> np.ndarray:
        """The head's own state for batch item i (what it feeds back as its next input)."""
        return ext.rows("llama_get_embeddings_nextn_ith", self._ctx, i, shape=(self.n_state,))

    def nextn_rows(self, n_rows: int) -> np.ndarray:
        """A copy of the last decode's first n_rows head states (an encoder's output)."""
        return ext.rows("llama_get_embeddings_nextn", self._ctx, shape=(n_rows, self.n_state))

    def export_nextn(self, on: bool, masked: bool) -> None:
        """This context keeps its own head states (masked: for its output rows only)."""
        fn("llama_set_embeddings_nextn")(self._ctx, on, masked)

    def layer_offset(self, k: int) -> None:
        """Which of the model's prediction layers the next decodes run (chained MTP)."""
        fn("llama_set_nextn_layer_offset")(self._ctx, k)

    def causal(self, on: bool) -> None:
        ll.llama_set_causal_attn(self._ctx, on)

    def pos_max(self) -> int:
        """The highest position the cache holds (-1 when empty)."""
        return int(ll.llama_memory_seq_pos_max(self._mem, self.seq))

    def rewind(self, n_keep: int) -> None:
        """Keep the first n_keep of the target's tokens the head has taken in (`tokens`),
        and the cache's positions before n_keep."""
        del self.tokens[n_keep:]
        self.rewind_cells(n_keep)

    def shift(self, n_keep: int, n_discard: int) -> bool:
        """A head's cache follows the target's hidden states: it is not shifted (a
        generation with a head ends at a full context)."""
        return False

    def rewind_cells(self, pos: int) -> None:
        """Drop the cache's positions from pos on (a draft's own cells; none when the cache
        is the target's, where llama.cpp leaves them to the target)."""
        # a removal scans every cell of the context: skipped when none is at pos or after
        if self._ctx and ll.llama_memory_seq_pos_max(self._mem, self.seq) >= pos:
            ll.llama_memory_seq_rm(self._mem, self.seq, pos, -1)

    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            fn("llama_batch_ext_free")(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            ll.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_owned", None) is not None:
            self._owned.close()
        self._model = None

    def __del__(self):
        self.close()
