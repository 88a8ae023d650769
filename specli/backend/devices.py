"""Devices: ggml's backend registry (--list-devices, -dev, -sm, -ts, -mg, -ot), the RPC backend
(--rpc, and a worker: specli rpc-server) and the KV cache types."""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from specli import rpc
from specli.backend._lib import P, ggml_fn, last_error, ll
from specli.config import ModelParams
from specli.errors import BackendError, ModelFileError, UsageError

_KV_TYPES = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
    "iq4_nl": 20, "bf16": 30,
}

_dev_count = ggml_fn("ggml_backend_dev_count", ctypes.c_size_t)
_dev_get = ggml_fn("ggml_backend_dev_get", P, ctypes.c_size_t)
_dev_name = ggml_fn("ggml_backend_dev_name", ctypes.c_char_p, P)
_dev_description = ggml_fn("ggml_backend_dev_description", ctypes.c_char_p, P)
_dev_memory = ggml_fn("ggml_backend_dev_memory", None, P, ctypes.POINTER(ctypes.c_size_t),
                 ctypes.POINTER(ctypes.c_size_t))
_dev_type = ggml_fn("ggml_backend_dev_type", ctypes.c_int, P)
_dev_buffer_type = ggml_fn("ggml_backend_dev_buffer_type", P, P)
_buft_name = ggml_fn("ggml_backend_buft_name", ctypes.c_char_p, P)
_load_all = ggml_fn("ggml_backend_load_all", None)
_DEVICE_TYPES = ("CPU", "GPU", "IGPU", "ACCEL", "META")  # enum ggml_backend_dev_type
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2, "tensor": 3}  # enum llama_split_mode
_devices_loaded = False


class _BuftOverride(ctypes.Structure):  # struct llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", P)]


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
_reg_by_name = ggml_fn("ggml_backend_reg_by_name", P, ctypes.c_char_p)
_reg_proc = ggml_fn("ggml_backend_reg_get_proc_address", P, P, ctypes.c_char_p)
_register = ggml_fn("ggml_backend_register", None, P)
_dev_by_name = ggml_fn("ggml_backend_dev_by_name", P, ctypes.c_char_p)
_ABORT_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_set_abort = ggml_fn("ggml_set_abort_callback", P, _ABORT_CB)
_ADD_SERVER = ctypes.CFUNCTYPE(P, ctypes.c_char_p)
_START_SERVER = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                 ctypes.c_size_t, ctypes.POINTER(P))
_rpc_devices: dict[str, tuple[str, ...]] = {}  # endpoint -> its devices' names (RPC0, ...)
_rpc_lock = threading.Lock()


@_ABORT_CB
def _on_abort(message):  # ggml_abort's last words: an RPC worker lost ends here, not in abort()
    text = message.decode("utf-8", "replace") if message else ""
    if "ggml-rpc" in text:  # the file that aborted: ggml-rpc.cpp
        # the workers added, and this thread's last error line (a version mismatch says so)
        rpc.lost(text, tuple(_rpc_devices), last_error())
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
    arr = (P * len(handles))(*handles)
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


def placement(mp, params: ModelParams) -> list:
    """Fill llama_model_params' device fields from ModelParams (llama.cpp's -dev, -sm, -ts,
    -mg, -ot/-cmoe/-ncmoe). Returns the ctypes arrays, to keep alive while the model loads."""
    keep: list = []
    connect_rpc(params.rpc)  # the workers' devices first: -dev may name them
    mp.split_mode = SPLIT_MODES[params.split_mode]
    mp.main_gpu = params.main_gpu
    if params.devices is not None:
        devs = _offload_devices(params.devices)
        arr = (P * (len(devs) + 1))(*devs, None)  # NULL-terminated; [NULL] alone: no offload
        mp.devices = ctypes.cast(arr, P).value
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
        mp.tensor_buft_overrides = ctypes.cast(arr, P).value
        keep.append(arr)
    return keep


def check_placement(params: ModelParams) -> None:
    """Refuse a device or buffer type this build lacks, before any weights are read."""
    placement(ll.llama_model_default_params(), params)


def kv_type(name: str | None) -> int | None:
    if name is None:
        return None
    try:
        return _KV_TYPES[name.lower()]
    except KeyError:
        raise ModelFileError(
            f"unknown KV cache type {name!r}", hint="one of: " + ", ".join(_KV_TYPES)
        ) from None
