"""The only module that imports llama_cpp: GGUF models on llama-cpp-python's low-level ctypes API.

`Model` is one GGUF with one context and one sequence. It remembers which tokens its KV cache
holds (`tokens`), decodes new ones at the next positions, returns zero-copy numpy views of only
the logits rows asked for, and rewinds. Each model accumulates the wall time spent inside
llama_decode, so the engine can split draft from target time without llama_perf_context (which
bills two interleaved contexts' work to whichever reads logits first).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llama_cpp as ll
import numpy as np

from specli import rpc
from specli.config import ModelParams
from specli.errors import BackendError, ContextOverflowError, ModelFileError, UsageError

_KV_TYPES = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
    "iq4_nl": 20, "bf16": 30,
}
_FLASH_ATTN = {
    "auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": ll.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}
QUANT_TYPES = {"f32": ll.LLAMA_FTYPE_ALL_F32, "f16": ll.LLAMA_FTYPE_MOSTLY_F16,
               "q8_0": ll.LLAMA_FTYPE_MOSTLY_Q8_0,
               # weaker drafts for draft-tree benchmarks (llama.cpp falls back to another
               # type for tensors whose rows are not a multiple of 256)
               "q2_k": ll.LLAMA_FTYPE_MOSTLY_Q2_K, "q3_k_s": ll.LLAMA_FTYPE_MOSTLY_Q3_K_S}

_log_lock = threading.Lock()
_log_verbose = False


_GGML_LOG_LEVEL_ERROR = 4  # ggml.h
_log_last = threading.local()  # this thread's last error line (a grammar's parse error)


@ll.llama_log_callback
def _log_callback(level, text, user_data):  # llama.cpp's log: silent unless -v
    line = text.decode("utf-8", errors="replace")
    if level == _GGML_LOG_LEVEL_ERROR:
        _log_last.error = line.strip()
    if _log_verbose:
        sys.stderr.write(line)


def set_verbose(verbose: bool) -> None:
    global _log_verbose
    with _log_lock:
        _log_verbose = verbose


ll.llama_log_set(_log_callback, ctypes.c_void_p(0))
ll.llama_backend_init()


# -- devices: ggml's backend registry, which llama.h does not wrap --------------------------
# libllama's handle reaches the ggml symbols it links against (dlsym searches dependencies)
_ggml = ll.llama_cpp._lib


def _c(name: str, restype, *argtypes):
    f = getattr(_ggml, name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


_P = ctypes.c_void_p
_dev_count = _c("ggml_backend_dev_count", ctypes.c_size_t)
_dev_get = _c("ggml_backend_dev_get", _P, ctypes.c_size_t)
_dev_name = _c("ggml_backend_dev_name", ctypes.c_char_p, _P)
_dev_description = _c("ggml_backend_dev_description", ctypes.c_char_p, _P)
_dev_memory = _c("ggml_backend_dev_memory", None, _P, ctypes.POINTER(ctypes.c_size_t),
                 ctypes.POINTER(ctypes.c_size_t))
_dev_type = _c("ggml_backend_dev_type", ctypes.c_int, _P)
_dev_buffer_type = _c("ggml_backend_dev_buffer_type", _P, _P)
_buft_name = _c("ggml_backend_buft_name", ctypes.c_char_p, _P)
_load_all = _c("ggml_backend_load_all", None)
_DEVICE_TYPES = ("CPU", "GPU", "IGPU", "ACCEL", "META")  # enum ggml_backend_dev_type
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2, "tensor": 3}  # enum llama_split_mode
_devices_loaded = False


class _BuftOverride(ctypes.Structure):  # struct llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", _P)]


@dataclass(frozen=True)
class Device:
    """One ggml backend device (llama.cpp's --list-devices leaves the CPU out; we do not)."""

    name: str
    description: str
    type: str  # CPU, GPU, IGPU (integrated), ACCEL (BLAS, AMX...), META
    memory_total: int  # bytes
    memory_free: int


def _registry() -> list[int]:
    global _devices_loaded
    if not _devices_loaded:  # dynamic-backend builds register their devices only now
        _load_all()
        _devices_loaded = True
    return [_dev_get(i) for i in range(_dev_count())]


def list_devices() -> list[Device]:
    """Every device this build of llama.cpp can use, the CPU included."""
    out = []
    for d in _registry():
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        _dev_memory(d, ctypes.byref(free), ctypes.byref(total))
        kind = _dev_type(d)
        out.append(Device(_dev_name(d).decode(), (_dev_description(d) or b"").decode(),
                          _DEVICE_TYPES[kind] if 0 <= kind < len(_DEVICE_TYPES) else str(kind),
                          total.value, free.value))
    return out


def supports_gpu_offload() -> bool:
    """llama.cpp's answer: true for a GPU build, and for any build with the RPC backend."""
    return bool(ll.llama_supports_gpu_offload())


def local_gpu() -> bool:
    """A GPU in this machine (RPC devices are GPUs to llama.cpp, but not here): where each
    distinct batch shape costs a CUDA graph capture."""
    return any(_dev_type(d) in (1, 2) and not _dev_name(d).startswith(b"RPC")
               for d in _registry())


# -- llama.cpp's RPC backend: remote devices (--rpc), and a worker (specli rpc-server) -------
_reg_by_name = _c("ggml_backend_reg_by_name", _P, ctypes.c_char_p)
_reg_proc = _c("ggml_backend_reg_get_proc_address", _P, _P, ctypes.c_char_p)
_register = _c("ggml_backend_register", None, _P)
_dev_by_name = _c("ggml_backend_dev_by_name", _P, ctypes.c_char_p)
_ABORT_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_set_abort = _c("ggml_set_abort_callback", _P, _ABORT_CB)
_ADD_SERVER = ctypes.CFUNCTYPE(_P, ctypes.c_char_p)
_START_SERVER = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                 ctypes.c_size_t, ctypes.POINTER(_P))
_rpc_devices: dict[str, tuple[str, ...]] = {}  # endpoint -> its devices' names (RPC0, ...)
_rpc_lock = threading.Lock()


@_ABORT_CB
def _on_abort(message):  # ggml_abort's last words: an RPC worker lost ends here, not in abort()
    text = message.decode("utf-8", "replace") if message else ""
    if "ggml-rpc" in text:  # the file that aborted: ggml-rpc.cpp
        # the workers added, and this thread's last error line (a version mismatch says so)
        rpc.lost(text, tuple(_rpc_devices), getattr(_log_last, "error", None))
    sys.stderr.write(text + "\n")  # anything else: llama.cpp's own abort, as before


def _rpc_proc(name: bytes, what: str) -> int:
    _registry()
    reg = _reg_by_name(b"RPC")
    fn = _reg_proc(reg, name) if reg else None
    if not fn:
        raise rpc.RpcUnavailable(what)
    return fn


def rpc_available() -> bool:
    """Whether this build of llama.cpp has the RPC backend (-DGGML_RPC=on)."""
    try:
        _rpc_proc(b"ggml_backend_rpc_add_server", "")
    except rpc.RpcUnavailable:
        return False
    return True


def connect_rpc(endpoints: Sequence[str]) -> list[str]:
    """Add RPC servers' devices to this process (llama.cpp's --rpc), once per endpoint; they
    join the offload devices (RPC0, RPC1, ...). Returns their names. A worker lost later ends
    in rpc.lost() instead of llama.cpp's abort."""
    if not endpoints:
        return []
    add = _ADD_SERVER(_rpc_proc(b"ggml_backend_rpc_add_server", "--rpc"))
    names: list[str] = []
    with _rpc_lock:
        _set_abort(_on_abort)
        for ep in endpoints:
            if ep not in _rpc_devices:
                rpc.check_reachable([ep])
                _rpc_devices[ep] = ()  # named already, should llama.cpp abort while adding it
                reg = add(ep.encode())
                if not reg:
                    del _rpc_devices[ep]
                    raise BackendError(f"the RPC server {ep} offers no device")
                before = _dev_count()
                _register(reg)
                _rpc_devices[ep] = tuple(_dev_name(_dev_get(i)).decode()
                                         for i in range(before, _dev_count()))
            names += _rpc_devices[ep]
    return names


def start_rpc_server(endpoint: str, cache_dir: str | None, n_threads: int,
                     devices: Sequence[str] = ()) -> None:
    """llama.cpp's rpc-server in this process: serves one client at a time, forever. Returns
    only if it could not start (llama.cpp said why on stderr). devices: names (default: the
    accelerators, else the CPU, as rpc-server chooses)."""
    start = _START_SERVER(_rpc_proc(b"ggml_backend_rpc_start_server", "rpc-server"))
    if devices:
        handles = []
        for name in devices:
            d = _dev_by_name(name.encode())
            if not d:
                raise UsageError(f"-d/--device: no device {name!r} in this build of llama.cpp",
                                 hint="available: " + ", ".join(x.name for x in list_devices()))
            handles.append(d)
    else:
        handles = [d for d in _registry() if _dev_type(d) not in (0, 3)]  # not CPU or ACCEL
        handles = handles or [d for d in _registry() if _dev_type(d) == 0][:1]
    arr = (_P * len(handles))(*handles)
    start(endpoint.encode(), cache_dir.encode() if cache_dir else None, n_threads,
          len(handles), arr)


def _offload_devices(names: tuple[str, ...]) -> list[int]:
    """-dev's names as device handles; as in llama.cpp, the CPU is not an offload device."""
    by_name = {_dev_name(d).decode().lower(): d for d in _registry()}
    found = []
    for name in names:
        d = by_name.get(name.lower())
        if d is None or _dev_type(d) == 0:
            usable = [n.name for n in list_devices() if n.type != "CPU"]
            raise UsageError(f"-dev/--device: no offload device {name!r} in this build of "
                             "llama.cpp",
                             hint="available: " + (", ".join(usable) or "none (a CPU-only "
                                                   "build)") + "; see --list-devices")
        found.append(d)
    return found


def _buffer_types() -> dict[str, int]:
    bufts = {}
    for d in _registry():
        b = _dev_buffer_type(d)
        if b:
            bufts[_buft_name(b).decode()] = b
    return bufts


def _placement(mp, params: ModelParams) -> list:
    """Fill llama_model_params' device fields from ModelParams (llama.cpp's -dev, -sm, -ts,
    -mg, -ot/-cmoe/-ncmoe). Returns the ctypes arrays, to keep alive while the model loads."""
    keep: list = []
    connect_rpc(params.rpc)  # the workers' devices first: -dev may name them
    mp.split_mode = SPLIT_MODES[params.split_mode]
    mp.main_gpu = params.main_gpu
    if params.devices is not None:
        devs = _offload_devices(params.devices)
        arr = (_P * (len(devs) + 1))(*devs, None)  # NULL-terminated; [NULL] alone: no offload
        mp.devices = ctypes.cast(arr, _P).value
        keep.append(arr)
    if params.tensor_split:
        n = ll.llama_max_devices()
        if len(params.tensor_split) >= n:
            raise UsageError(f"-ts/--tensor-split: {len(params.tensor_split)} proportions, but "
                             f"this build takes at most {n - 1}")
        ts = (ctypes.c_float * n)(*params.tensor_split)
        mp.tensor_split = ts
        keep.append(ts)
    if params.tensor_overrides:
        bufts = _buffer_types()
        n_max = ll.llama_max_tensor_buft_overrides()
        if len(params.tensor_overrides) >= n_max:
            raise UsageError(f"{len(params.tensor_overrides)} tensor overrides; llama.cpp takes "
                             f"at most {n_max - 1}")
        rows = []
        for pattern, buft in params.tensor_overrides:
            if buft not in bufts:
                raise UsageError(f"-ot/--override-tensor: unknown buffer type {buft!r}",
                                 hint="available: " + ", ".join(sorted(bufts)))
            rows.append((pattern.encode(), bufts[buft]))
        arr = (_BuftOverride * (len(rows) + 1))(*rows, (None, None))
        mp.tensor_buft_overrides = ctypes.cast(arr, _P).value
        keep.append(arr)
    return keep


def check_placement(params: ModelParams) -> None:
    """Refuse a device or buffer type this build lacks, before any weights are read."""
    _placement(ll.llama_model_default_params(), params)


def kv_type(name: str | None) -> int | None:
    if name is None:
        return None
    try:
        return _KV_TYPES[name.lower()]
    except KeyError:
        raise ModelFileError(
            f"unknown KV cache type {name!r}", hint="one of: " + ", ".join(_KV_TYPES)
        ) from None


def _check_gguf(path: str) -> None:
    if not os.path.isfile(path):
        raise ModelFileError(f"model file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFileError(f"not a GGUF file: {path}",
                                 hint="specli reads llama.cpp GGUF models")
        st = os.fstat(f.fileno())
    _MAPPED[os.path.abspath(path)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    _catch_sigbus()


# -- a model file cut while in use --------------------------------------------------------------
# llama.cpp reads the weights through mmap: a file truncated under it turns the next read of a
# page past the new end into SIGBUS, which kills the process without a word. The handler says
# which file changed, in one line, and exits 2. It runs on the faulting thread (a ggml worker,
# or ours inside llama_decode, the GIL released), which can never resume.

_MAPPED: dict[str, tuple[int, int, int]] = {}  # path -> (inode, size, mtime) when loaded
_SIGBUS_HANDLER = None


def _changed() -> list[str]:
    out = []
    for path, seen in list(_MAPPED.items()):
        try:
            st = os.stat(path)
            if (st.st_ino, st.st_size, st.st_mtime_ns) != seen:
                out.append(path)
        except OSError:
            out.append(path)
    return out


def _on_sigbus(signum: int) -> None:
    changed = _changed()
    what = (f"{', '.join(changed)} changed while in use (truncated or rewritten)" if changed
            else "a memory-mapped file was cut short while in use (SIGBUS)")
    os.write(2, f"error: {what}: the weights cannot be read any more (hint: do not rewrite a "
                f"model file that a running specli reads; copy, then rename over it)\n"
             .encode("utf-8", "replace"))
    os._exit(2)


_SIGBUS_LOCK = threading.Lock()


def _catch_sigbus() -> None:
    """Install _on_sigbus as SIGBUS's handler, once (Linux: glibc's struct sigaction). The
    handler runs Python on the faulting thread, which is not async-signal-safe in general;
    here that thread can never resume, and the handler only writes one line and exits."""
    global _SIGBUS_HANDLER
    if not sys.platform.startswith("linux"):
        return
    with _SIGBUS_LOCK:
        if _SIGBUS_HANDLER is None:
            _SIGBUS_HANDLER = _install_sigbus()


def _install_sigbus():
    import signal

    handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(_on_sigbus)

    class SigAction(ctypes.Structure):
        _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16),
                    ("flags", ctypes.c_int), ("restorer", ctypes.c_void_p)]

    act = SigAction()
    act.handler = ctypes.cast(handler, ctypes.c_void_p)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sigaction(int(signal.SIGBUS), ctypes.byref(act), None)
    return handler  # kept alive by the caller: C holds its address


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
        _check_gguf(path)
        set_verbose(verbose)
        mp = ll.llama_model_default_params()
        mp.vocab_only = True
        self._model = ll.llama_model_load_from_file(path.encode(), mp)
        if not self._model:
            raise ModelFileError(f"llama.cpp could not read the vocabulary of {path}",
                                 hint="rerun with -v")
        self._vocab = ll.llama_model_get_vocab(self._model)
        self.n_vocab = ll.llama_vocab_n_tokens(self._vocab)

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        return _tokenize(self._vocab, text, add_special, parse_special)

    def close(self) -> None:
        if getattr(self, "_model", None):
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        self.close()


class Model:
    """One GGUF model, one context, one sequence. A context may hold n_seq_max sequences (a
    server's slots, batching.SharedContext): `share` makes a Model for sequence `seq` of
    another Model's context, with its own tokens and timings, that frees nothing on close."""

    def __init__(self, params: ModelParams, n_seq_max: int = 1, *, share: Model | None = None,
                 seq: int = 0, tree: bool = False):
        self.params, self.seq = params, seq  # the sequence id this model's tokens live in
        # tree: n_seq_max sequences over one unified cache of n_ctx cells, the branches of a
        # draft tree (branch 0 holds the committed tokens; decode_tree, keep)
        self.n_branch = n_seq_max if tree else 1
        self.tokens: list[int] = []  # what the KV cache holds, position i = tokens[i]
        self.t_decode_s = 0.0  # wall time inside llama_decode (and the wait for the device)
        self.n_decode_calls = 0
        self.n_decode_tokens = 0
        self._local = threading.local()
        self._views: dict[tuple[int, int], np.ndarray] = {}
        self._owner = share is None
        if share is not None:
            self._model, self._ctx, self._vocab, self._mem = (share._model, share._ctx,
                                                              share._vocab, share._mem)
            self._batch = None  # its decodes go through whoever owns the context
            self.load_ms, self.offloaded = share.load_ms, share.offloaded
            self.n_vocab, self.n_batch, self.n_ctx = share.n_vocab, share.n_batch, share.n_ctx_seq
            self.n_embd = share.n_embd
            return
        _check_gguf(params.path)
        set_verbose(params.verbose)
        t0 = time.perf_counter()
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = params.n_gpu_layers
        keep = _placement(mp, params)
        self._model = ll.llama_model_load_from_file(params.path.encode(), mp)
        self._keep = keep  # llama.cpp keeps the device and override arrays' pointers
        if not self._model:
            placed = (params.devices is not None or params.tensor_overrides
                      or params.split_mode != "layer" or params.main_gpu or params.tensor_split)
            raise ModelFileError(f"llama.cpp could not load {params.path} (damaged or truncated "
                                 "GGUF, an unsupported architecture" +
                                 (", or a placement it refused: -dev/-sm/-ts/-mg/-ot"
                                  if placed else "") + ")", hint="rerun with -v")
        cp = ll.llama_context_default_params()
        cp.n_ctx = params.n_ctx
        cp.n_batch = params.n_batch
        cp.n_ubatch = min(params.n_ubatch, params.n_batch)
        cp.n_seq_max = n_seq_max  # > 1: a SharedContext's sequences, n_ctx / n_seq_max each
        cp.kv_unified = tree  # a tree's branches share cells and the whole context
        cp.n_threads = params.n_threads
        cp.n_threads_batch = params.n_threads_batch or params.n_threads
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
        self._vocab = ll.llama_model_get_vocab(self._model)
        self._mem = ll.llama_get_memory(self._ctx)
        self.n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        self.n_layer = ll.llama_model_n_layer(self._model)
        self.n_embd = ll.llama_model_n_embd(self._model)
        self.n_ctx = ll.llama_n_ctx(self._ctx)
        self.n_batch = ll.llama_n_batch(self._ctx)  # llama.cpp caps n_batch at n_ctx
        # layers on a GPU: there each distinct batch shape costs a CUDA graph capture
        self.offloaded = (local_gpu() and params.n_gpu_layers != 0
                          and params.devices != ())
        self._batch = ll.llama_batch_init(self.n_batch, 0, n_seq_max if tree else 1)
        if params.rpc:  # its connections to the workers are open now: notice a vanished one
            rpc.keepalive(params.rpc)

    # -- vocabulary -------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        return _tokenize(self._vocab, text, add_special, parse_special)

    def tokenize_bytes(self, data: bytes, add_special: bool = False,
                       parse_special: bool = False) -> list[int]:
        """UTF-8 text as bytes (what token_bytes spells), tokenized."""
        return _tokenize(self._vocab, bytes(data), add_special, parse_special)

    @property
    def eos_token(self) -> int | None:
        """The end-of-sequence token, if the vocabulary has one."""
        t = ll.llama_vocab_eos(self._vocab)
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
        # a buffer per thread: a server tokenizes requests while a slot thread decodes
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = ctypes.create_string_buffer(256)
        n = ll.llama_token_to_piece(self._vocab, token, buf, 256, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
            return buf.raw[:n]
        return buf.raw[:n]

    @functools.cached_property
    def eog(self) -> tuple[int, ...]:
        """Every end-of-generation token of the vocabulary (once per model)."""
        return tuple(t for t in range(self.n_vocab) if ll.llama_vocab_is_eog(self._vocab, t))

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest text one token spells (special tokens included): n tokens never spell
        more than n times this, which bounds a prompt before it is tokenized."""
        buf = ctypes.create_string_buffer(1024)
        longest = 1
        for t in range(self.n_vocab):
            n = ll.llama_token_to_piece(self._vocab, t, buf, 1024, 0, True)
            longest = max(longest, -n if n < 0 else n)
        return longest

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self._vocab, token))

    def special_text(self, which: str) -> str:
        tok = {"bos": ll.llama_vocab_bos, "eos": ll.llama_vocab_eos}[which](self._vocab)
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
            secs, calls = self.decode_chunked(tokens, len(self.tokens), self.seq, n_out)
        except BackendError:
            self._truncate(len(self.tokens))  # drop what a failed chunk left in the cache
            raise
        self.t_decode_s += secs
        self.n_decode_calls += calls
        self.n_decode_tokens += len(tokens)
        self.tokens.extend(tokens)
        return self.rows(n_out)

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
        ll.llama_memory_seq_rm(self._mem, self.seq + dst, -1, -1)
        ll.llama_memory_seq_cp(self._mem, self.seq + src, self.seq + dst, -1, -1)

    def decode_tree(self, tokens: Sequence[int], pos: Sequence[int],
                    seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """One llama_decode of tree nodes: token i at position pos[i], in every branch of
        seqs[i] (the branches that pass through it), a logits row each. Nodes come parents
        first; `tokens` (branch 0's) is unchanged until `keep`."""
        n = self._check_tree(tokens, pos)
        items = [(t, p, [self.seq + s for s in ss], True)
                 for t, p, ss in zip(tokens, pos, seqs, strict=True)]
        self.t_decode_s += self.decode_items(items)
        self.n_decode_calls += 1
        self.n_decode_tokens += n
        return self.rows(n)

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
        b.n_tokens = len(items)
        t0 = time.perf_counter()
        rc = ll.llama_decode(self._ctx, b)
        if rc != 0:
            raise BackendError(f"llama_decode failed with code {rc}", hint="rerun with -v")
        ll.llama_synchronize(self._ctx)  # a GPU returns early: wait, or reading pays for it
        return time.perf_counter() - t0

    def keep(self, seq: int, tokens: Sequence[int]) -> None:
        """Branch `seq` up to len(tokens) becomes the committed branch 0, holding `tokens`
        (its cells, which the caller knows spell them); every other branch and every cell
        past them is dropped. Other models' sequences of a shared context are untouched."""
        n, base = len(tokens), self.seq
        ll.llama_memory_seq_rm(self._mem, base + seq, n, -1)
        if seq != 0:
            ll.llama_memory_seq_rm(self._mem, base, -1, -1)
            ll.llama_memory_seq_cp(self._mem, base + seq, base, -1, -1)
        for s in range(1, self.n_branch):
            ll.llama_memory_seq_rm(self._mem, base + s, -1, -1)
        self.tokens[:] = tokens

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        """The lowest and highest position branch `seq` holds ((-1, -1) when empty)."""
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
        # one view per (buffer, rows): llama.cpp moves the buffer only when it grows it, and
        # building a view costs as much as a GPU-side argmax (every draft token pays it)
        key = (ctypes.cast(ptr, ctypes.c_void_p).value, n_out)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 64:
                self._views.clear()
            view = self._views[key] = np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))
        return view

    def rewind(self, n_keep: int) -> None:
        """Drop every cached token from position n_keep on."""
        if n_keep < len(self.tokens):
            self._truncate(n_keep)

    def _truncate(self, n_keep: int) -> None:
        if not ll.llama_memory_seq_rm(self._mem, self.seq, n_keep, -1):
            # partial removal refused (recurrent models): start over rather than lie
            ll.llama_memory_seq_rm(self._mem, self.seq, -1, -1)
            self.tokens.clear()
            raise BackendError("this model's cache cannot be rolled back partially",
                               hint="speculative decoding needs a transformer KV cache")
        del self.tokens[n_keep:]

    def kv_pos_max(self) -> int:
        """The highest position llama.cpp holds for the sequence (-1 when empty)."""
        return int(ll.llama_memory_seq_pos_max(self._mem, self.seq))

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
        ll.llama_set_embeddings(self._ctx, on)

    def hidden(self, n_out: int) -> np.ndarray:
        """The last decode's n_out hidden states (n_out, n_embd), as a view valid until the
        next decode; the decode must have run with set_hidden(True)."""
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


# -- grammars: llama.cpp's GBNF sampler, used as a test of which tokens may come next --------

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data


class _Sampler:
    """A llama.cpp sampler whose state moves with accepted tokens: apply it to candidates,
    accept a token, fork (clone) the state, free it."""

    _s = None

    def _apply(self, data: np.ndarray) -> None:
        """Run the sampler over a _TOKEN_DATA array, in place."""
        arr = ll.llama_token_data_array(
            data.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)), len(data), -1, False)
        ll.llama_sampler_apply(self._s, ctypes.byref(arr))

    def _clone(self):
        return ll.llama_sampler_clone(self._s)

    def accept(self, token: int) -> None:
        ll.llama_sampler_accept(self._s, token)

    def close(self) -> None:
        if self._s:
            ll.llama_sampler_free(self._s)
            self._s = None

    def __del__(self) -> None:
        self.close()


class Grammar(_Sampler):
    """A GBNF grammar's parse state over a model's vocabulary (llama.cpp's grammar sampler).
    `allowed` asks which candidate tokens may come next; `accept` moves past a token, which
    must be one it allowed (llama.cpp aborts the process otherwise); `fork` copies the state,
    for a draft or a verification to walk ahead without moving the committed one."""

    def __init__(self, model: Model | Tokenizer | None, gbnf: str | None,
                 root: str = "root", _handle=None):
        if _handle is None:
            _check_nesting(gbnf)
            _log_last.error = None
            _handle = ll.llama_sampler_init_grammar(model._vocab, gbnf.encode(), root.encode())
            if not _handle:
                why = _log_last.error or "llama.cpp could not parse it"
                raise UsageError(f"the grammar is not valid GBNF: {why}",
                                 hint="see llama.cpp's grammars/README.md")
        self._s = _handle

    def fork(self) -> Grammar:
        return Grammar(None, None, _handle=self._clone())

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        """A mask over `ids`: True where the grammar lets the token come next."""
        data = np.zeros(len(ids), dtype=_TOKEN_DATA)
        data["id"] = ids
        self._apply(data)
        return np.isfinite(data["logit"])


class Dry(_Sampler):
    """llama.cpp's DRY sampler ("don't repeat yourself"): penalizes the token that would
    extend a repetition of what it has accepted. `apply` returns the row changed (the
    sampler neither reorders nor resizes the candidates); `fork` copies the state."""

    def __init__(self, model: Model | None, sp=None, _handle=None):
        if _handle is None:
            breakers = [b.encode() for b in sp.dry_sequence_breakers]
            arr = (ctypes.c_char_p * max(len(breakers), 1))(*breakers)
            n_last = sp.dry_penalty_last_n if sp.dry_penalty_last_n >= 0 else model.n_ctx
            _handle = ll.llama_sampler_init_dry(model._vocab, sp.dry_multiplier, sp.dry_base,
                                                sp.dry_allowed_length, n_last, arr,
                                                len(breakers))
            if not _handle:
                raise UsageError("llama.cpp refused the DRY settings")
        self._s = _handle

    def fork(self) -> Dry:
        return Dry(None, _handle=self._clone())

    def apply(self, row: np.ndarray) -> np.ndarray:
        data = np.empty(row.shape[0], dtype=_TOKEN_DATA)
        data["id"] = _ids(row.shape[0])
        data["logit"] = row
        data["p"] = 0.0
        self._apply(data)
        return data["logit"].copy()


@functools.lru_cache(maxsize=4)
def _ids(n: int) -> np.ndarray:
    """0..n-1, made once per vocabulary size."""
    return np.arange(n, dtype=np.int32)


GRAMMAR_MAX_NESTING = 256
GRAMMAR_MAX_RULES = 4096


def _check_nesting(gbnf: str) -> None:
    """Refuse a grammar nested deeper than GRAMMAR_MAX_NESTING parentheses: llama.cpp's parser
    recurses once per level, and a hostile depth would overflow the C stack. Likewise more
    than GRAMMAR_MAX_RULES rules (a chain of rules is walked recursively)."""
    if gbnf.count("::=") > GRAMMAR_MAX_RULES:
        raise UsageError(f"the grammar has more than {GRAMMAR_MAX_RULES} rules")
    depth, quote, i = 0, None, 0
    while i < len(gbnf):
        c = gbnf[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"[":
            quote = "]" if c == "[" else c
        elif c == "#":  # a comment runs to the end of the line
            j = gbnf.find("\n", i)
            i = len(gbnf) if j < 0 else j
        elif c == "(":
            depth += 1
            if depth > GRAMMAR_MAX_NESTING:
                raise UsageError(f"the grammar nests parentheses more than "
                                 f"{GRAMMAR_MAX_NESTING} deep")
        elif c == ")":
            depth = max(depth - 1, 0)
        i += 1


def schema_grammar(schema: dict) -> str:
    """A JSON schema as GBNF, by llama-cpp-python's converter (llama.cpp's own, in Python);
    UsageError naming what it cannot convert."""
    import json

    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except (ValueError, TypeError, KeyError, AssertionError, NotImplementedError,
            RecursionError) as e:
        raise UsageError(f"the JSON schema cannot be turned into a grammar: {e}") from None


def quantize(src: str, dst: str, ftype: str) -> None:
    """Requantize a GGUF (e.g. Q4_1 -> F16) with llama.cpp; written to dst atomically."""
    params = ll.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[ftype]
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = f"{dst}.tmp{os.getpid()}"
    rc = ll.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise BackendError(f"llama_model_quantize failed ({rc}) on {src}")
    os.replace(tmp, dst)


# -- llama.cpp's built-in chat templates (its C++ renderers, no Jinja) ----------------------

@functools.cache
def builtin_templates() -> tuple[str, ...]:
    """The names llama.cpp renders in C++ (llama_chat_builtin_templates): chatml, llama3..."""
    n = ll.llama_chat_builtin_templates((ctypes.c_char_p * 0)(), 0)
    names = (ctypes.c_char_p * n)()
    ll.llama_chat_builtin_templates(names, n)
    return tuple(x.decode() for x in names)


@functools.lru_cache(maxsize=16)
def knows_template(template: str) -> bool:
    """Whether llama.cpp renders this template itself (a built-in name, or a template it
    recognises by its text)."""
    try:
        apply_builtin_template(template, [{"role": "user", "content": "test"}])
    except UsageError:
        return False
    return True


def apply_builtin_template(template: str, messages: Sequence[dict],
                           add_generation_prompt: bool = True) -> str:
    """A conversation through llama_chat_apply_template: a built-in name, or a template
    llama.cpp recognises by its text (llama-server's route without --jinja). UsageError for
    one it does not know, and for text it cannot pass (a NUL would end a C string early)."""
    texts = [(str(m.get("role", "")), str(m.get("content") or "")) for m in messages]
    if any("\x00" in r or "\x00" in c for r, c in texts) or "\x00" in template:
        raise UsageError("a message holds a NUL character, which llama.cpp's built-in chat "
                         "templates cannot pass", hint="remove it, or use a Jinja template")
    enc = [(r.encode(), c.encode()) for r, c in texts]  # kept alive while C reads them
    chat = (ll.llama_chat_message * max(len(enc), 1))(
        *[ll.llama_chat_message(r, c) for r, c in enc])
    size = 2 * sum(len(r) + len(c) for r, c in enc) + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = ll.llama_chat_apply_template(template.encode(), chat, len(enc),
                                         add_generation_prompt, buf, size)
        if n < 0:
            raise UsageError("llama.cpp does not know this chat template",
                             hint="name a built-in one (" + ", ".join(builtin_templates()[:6])
                             + "...) or pass Jinja with --jinja")
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n  # the buffer was too small: n is what it needs
    raise BackendError("llama_chat_apply_template kept asking for more room")
