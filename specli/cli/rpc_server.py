"""`specli rpc-server`: llama.cpp's rpc-server, from a Python install, for `--rpc`."""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Annotated

import typer

from specli import rpc
from specli.cli.console import err
from specli.errors import SpecliError, UsageError


def rpc_server(
    host: Annotated[str, typer.Option(
        "-H", "--host", help="The IPv4 address to bind to. Anything but 127.0.0.1 lets other "
        "machines in: the protocol has no authentication, keep it on a trusted "
        "network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("-p", "--port", help="The port to bind to.")]
        = rpc.DEFAULT_PORT,
    cache: Annotated[bool, typer.Option(
        "-c", "--cache", help="Keep the tensors over 10 MiB that clients send in a local "
        "file cache ($LLAMA_CACHE/rpc, else $XDG_CACHE_HOME or ~/.cache, /llama.cpp/rpc): "
        "the next load sends only their hashes.")] = False,
    threads: Annotated[int, typer.Option(
        "-t", "--threads", help="Threads for the CPU device. Default: half the CPUs.",
        show_default=False)] = max(1, (os.cpu_count() or 2) // 2),
    device: Annotated[str | None, typer.Option(
        "-d", "--device", metavar="DEV1,DEV2", help="Devices to serve, comma-separated "
        "(see specli run --list-devices). Default: the GPUs, else the CPU.",
        show_default=False)] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="llama.cpp's log.")] = False,
) -> None:
    """Serve this machine's devices to `specli run/serve --rpc` (and llama.cpp's --rpc) over
    llama.cpp's RPC protocol, one client at a time, until stopped. The same server as
    llama.cpp's rpc-server, started through llama-cpp-python: a Python-only install can be a
    worker. Exit 2 if it cannot start (address in use, no RPC in this build)."""
    rpc.check_bind_host(host)
    if not 0 < port < 65536:
        raise UsageError(f"-p/--port must be 1 to 65535, got {port}")
    if threads < 1:
        raise UsageError(f"-t/--threads must be 1 or more, got {threads}")
    devices = tuple(d.strip() for d in (device or "").replace("/", ",").split(",") if d.strip())
    from specli import backend

    backend.set_verbose(verbose)
    if not backend.rpc_available():
        raise rpc.RpcUnavailable("rpc-server")
    if host != "127.0.0.1":
        sys.stderr.write(rpc.EXPOSED.format(host=host) + "\n")
    _check_free(host, port)
    cache_dir = _cache_dir() if cache else None
    endpoint = f"{host}:{port}"
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            backend.start_rpc_server(endpoint, cache_dir, threads, devices)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            failed.append(e)

    worker = threading.Thread(target=serve, name="specli-rpc-server", daemon=True)
    worker.start()
    threading.Thread(target=_announce, args=(host, port, worker), daemon=True).start()
    try:
        while worker.is_alive():  # the server runs in C; this thread keeps Ctrl-C working
            worker.join(0.5)
    except KeyboardInterrupt:
        sys.stderr.flush()
        os._exit(130)  # the server thread is inside llama.cpp for good
    if failed and isinstance(failed[0], SpecliError):
        raise failed[0]
    raise SpecliError(f"the RPC server on {endpoint} stopped: "
                      f"{failed[0] if failed else 'llama.cpp said why above'}")


def _check_free(host: str, port: int) -> None:
    """llama.cpp says only "Failed to create server socket": say why, before it tries."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as llama.cpp binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise SpecliError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                              hint="choose another -p/--port, or stop what holds it") from None


def _cache_dir() -> str:
    """llama.cpp's: $LLAMA_CACHE/rpc, else $XDG_CACHE_HOME (or ~/.cache)/llama.cpp/rpc."""
    base = os.environ.get("LLAMA_CACHE")
    if not base:
        base = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                   / "llama.cpp")
    path = Path(base) / "rpc"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecliError(f"cannot create the cache directory {path}: {e.strerror or e}",
                          hint="set LLAMA_CACHE to a writable directory") from None
    return str(path)


def _listening(host: str, port: int) -> bool:
    """Whether this machine has a socket listening at host:port (/proc/net/tcp), found
    without connecting: a connection would be a client to the one-at-a-time server."""
    want_ip = socket.inet_aton(host)[::-1].hex().upper()  # /proc writes it little-endian
    want = f"{want_ip}:{port:04X}"
    try:
        with open("/proc/net/tcp") as f:
            return any(cols[1] == want and cols[3] == "0A"  # 0A: LISTEN
                       for cols in (line.split() for line in f.readlines()[1:]))
    except OSError:
        return True  # no /proc: say nothing more precise


def _announce(host: str, port: int, worker: threading.Thread) -> None:
    deadline = time.monotonic() + 30
    while worker.is_alive() and time.monotonic() < deadline:
        if _listening(host, port):
            ctypes.CDLL(None).fflush(None)  # llama.cpp's banner, printf'd to a pipe's buffer
            err.print(f"specli rpc-server: listening on {host}:{port}", markup=False)
            return
        time.sleep(0.05)
