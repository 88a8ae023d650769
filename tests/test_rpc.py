"""--rpc and `specli rpc-server` (issue 21): real workers on loopback ports, started through
llama.cpp's RPC backend in llama-cpp-python; a model split over this process and them; a
worker killed mid-generation."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import specli
from test_serve import Server

from specli import rpc
from specli.backend import rpc_available

needs_rpc = pytest.mark.skipif(not rpc_available(), reason="llama-cpp-python built without "
                               "RPC (CMAKE_ARGS=-DGGML_RPC=on)")
PROMPT = "Write a list of fruits and their colours:"
NO_EOS = ("-l", "0-inf", "-l", "1-inf", "-l", "2-inf")  # SmolLM2's end tokens: never stop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """`specli rpc-server` in a subprocess, ready once it says it listens."""

    def __init__(self, tmp: Path, *args: str, port: int | None = None,
                 wrap: tuple[str, ...] = ()):
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = tmp / f"worker-{self.port}.out"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*wrap, sys.executable, "-m", "specli", "rpc-server", "-p", str(self.port),
                 "-t", "1", *args], stdout=out, stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                self.err.append(line)
                if "listening on" in line:
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(60):
            self.kill()
            raise RuntimeError("worker did not start: " + "".join(self.err))

    def clients(self) -> int:
        return self.log.read_text().count("Accepted client connection")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    if not rpc_available():
        pytest.skip("llama-cpp-python built without RPC")
    tmp = tmp_path_factory.mktemp("rpc")
    ws = [Worker(tmp), Worker(tmp)]
    yield ws
    for w in ws:
        w.kill()


# -- flags ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["localhost", "host:port", "127.0.0.1:0", "127.0.0.1:70000",
                                   ":50052"])
def test_a_malformed_endpoint_is_a_usage_error(value):
    with pytest.raises(rpc.UsageError, match="HOST:PORT"):
        rpc.parse(value)


def test_endpoints_parse_as_llama_cpp_spells_them():
    assert rpc.parse("10.0.0.1:50052, 10.0.0.2:50052,10.0.0.1:50052") == (
        "10.0.0.1:50052", "10.0.0.2:50052")
    assert rpc.parse(None) == () == rpc.parse(" ")
    with pytest.raises(rpc.UsageError, match="at most 16"):
        rpc.parse(",".join(f"10.0.0.1:{p}" for p in range(1000, 1017)))


@pytest.mark.parametrize("command", ["run", "serve", "tune-draft", "audit", "check-pair"])
def test_every_command_that_loads_models_takes_rpc(command):
    from typer.testing import CliRunner

    from specli.cli.app import app

    r = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    assert re.search(r"--rpc HOST:PORT", r.output)


@needs_rpc
def test_a_worker_nobody_runs_is_one_line_before_any_weights(f16):
    port = free_port()
    r = specli("run", "-m", f16, "-p", "hi", "-n", "4", "--rpc", f"127.0.0.1:{port}",
               "-ngl", "99", timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines == [f"error: --rpc: cannot reach the RPC server 127.0.0.1:{port}: connection "
                     f"refused (hint: start one there: specli rpc-server -H 127.0.0.1 -p "
                     f"{port})"]
    r = specli("run", "-m", f16, "-p", "hi", "--rpc", "nohost", timeout=60)
    assert r.returncode == 2 and "takes HOST:PORT" in r.stderr and "Traceback" not in r.stderr


def test_an_isolated_audit_refuses_rpc_in_one_line(f16):
    r = specli("audit", "-m", f16, "-p", "hi", "--rpc", "127.0.0.1:50052", timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("error: --rpc reaches its RPC servers over the network")
    assert "--no-isolate" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# -- a build without RPC -------------------------------------------------------------------

def _native_lib_dir() -> Path | None:
    import importlib.metadata as md

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specli" / "native"
    d = cache / f"llama.cpp-{md.version('llama-cpp-python')}" / "bin"
    return d if (d / "libllama.so").is_file() else None


def test_without_the_rpc_registry_rpc_is_refused_with_the_install_line(monkeypatch):
    """The registry lookup answering nothing, as in a build without RPC (the test below runs
    a real one where .ci/run built it)."""
    from specli import backend
    from specli.backend import devices

    monkeypatch.setattr(devices, "_reg_by_name", lambda name: None)
    assert not backend.rpc_available()
    with pytest.raises(rpc.RpcUnavailable) as e:
        backend.connect_rpc(["127.0.0.1:50052"])
    assert e.value.exit_code == 2 and e.value.hint == f"reinstall it with RPC: {rpc.INSTALL}"


def test_a_build_without_rpc_names_the_install_line(f16):
    """The same llama-cpp-python on native llama.cpp libraries built without RPC (.ci/run
    builds them so): --rpc and rpc-server are one line each, exit 2."""
    lib = _native_lib_dir()
    rpc_off = lib is not None and re.search(r"^GGML_RPC:BOOL=(off|0|false|no)$", (
        lib.parent / "CMakeCache.txt").read_text(), re.M | re.I)
    if not rpc_off:
        pytest.skip("no native llama.cpp libraries built without RPC (scripts/build_native.sh)")
    env = {"LLAMA_CPP_LIB_PATH": str(lib)}
    for args in (("run", "-m", f16, "-p", "hi", "--rpc", "127.0.0.1:50052", "-ngl", "99"),
                 ("rpc-server", "-p", str(free_port()))):
        r = specli(*args, env=env, timeout=60)
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines() == [
            f"error: {'--rpc' if args[0] == 'run' else 'rpc-server'} needs llama.cpp's RPC "
            "backend, and this llama-cpp-python was built without it (hint: reinstall it with "
            f"RPC: {rpc.INSTALL})"]


# -- the worker -----------------------------------------------------------------------------

@needs_rpc
def test_the_worker_refuses_what_it_cannot_bind(tmp_path, workers):
    r = specli("rpc-server", "-p", str(workers[0].port), timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: cannot listen on 127.0.0.1:{workers[0].port}: Address "
                                "already in use (hint: choose another -p/--port, or stop what "
                                "holds it)")
    r = specli("rpc-server", "-H", "localhost", timeout=60)
    assert r.returncode == 2 and "must be an IPv4 address" in r.stderr


WARNING_LINES = ("WARNING: Host ('0.0.0.0') is != '127.0.0.1'",
                 "Never expose the RPC server to an open network!",
                 "This is an experimental feature and is not secure!")


@needs_rpc
def test_a_worker_bound_to_every_interface_warns(tmp_path, workers):
    """llama.cpp's warning, word for word, before it binds: here on a port a worker holds, so
    nothing ever listens on every interface (then, where namespaces are allowed, a real one
    inside a fresh network namespace that nothing outside this test can reach)."""
    r = specli("rpc-server", "-H", "0.0.0.0", "-p", str(workers[0].port), timeout=60)
    assert r.returncode == 2 and "Address already in use" in r.stderr
    assert all(line in r.stderr for line in WARNING_LINES)
    assert r.stderr.index(WARNING_LINES[0]) < r.stderr.index("error:")
    assert "WARNING" not in "".join(workers[0].err)  # 127.0.0.1: quiet
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--net", "true"], capture_output=True).returncode != 0:
        return
    w = Worker(tmp_path, "-H", "0.0.0.0", wrap=("unshare", "--net"))
    try:
        assert all(line in "".join(w.err) for line in WARNING_LINES)
    finally:
        w.kill()


@needs_rpc
def test_something_that_is_no_rpc_server_is_one_line_exit_2(f16):
    """A listener that accepts and hangs up (another service, or another llama.cpp's
    protocol): llama.cpp aborts in its handshake; specli says which server failed."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        port = srv.getsockname()[1]
        stop = threading.Event()

        def hang_up() -> None:
            srv.settimeout(0.2)
            while not stop.is_set():
                try:
                    srv.accept()[0].close()
                except OSError:
                    pass

        t = threading.Thread(target=hang_up, daemon=True)
        t.start()
        try:
            r = specli("run", "-m", f16, "-p", "hi", "-n", "2", "--rpc", f"127.0.0.1:{port}",
                       "-ngl", "99", timeout=60)
        finally:
            stop.set()
            t.join(5)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: an RPC server (127.0.0.1:{port}) failed: ")
    assert "same llama.cpp" in lines[0]


def test_a_server_whose_worker_answers_but_failed_does_not_restart_forever():
    """Restarting cannot mend a worker that answers and fails (a protocol mismatch): the
    server says it needs a restart instead of reloading in a loop."""
    from specli.config import ModelParams
    from specli.server.state import ServerConfig, State

    st = State(ServerConfig(target=ModelParams("x.gguf", rpc=("127.0.0.1:9",))))
    try:
        before = {t.name for t in threading.enumerate()}
        st.worker_lost(rpc.WorkerLost("an RPC server (127.0.0.1:9) failed: x", hint="h",
                                      unreachable=False), ("127.0.0.1:9",))
        assert st.down.endswith("this server needs a restart")
        assert "specli-rpc-watch" not in {t.name for t in threading.enumerate()} - before
    finally:
        rpc.on_lost(None)


def test_closed_sees_a_connection_its_worker_closed():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        ep = f"127.0.0.1:{srv.getsockname()[1]}"
        c = socket.create_connection(srv.getsockname())
        peer, _ = srv.accept()
        assert rpc.closed([ep]) == {}
        peer.close()  # the worker goes
        time.sleep(0.1)
        assert rpc.closed([ep]) == {ep: "its connection was closed"}
        c.close()
        assert rpc.closed([ep]) == {}  # no connection: nothing to say


# -- a model over the workers --------------------------------------------------------------

@needs_rpc
def test_run_split_over_local_and_two_workers_is_the_local_text(workers, f16, q4_1):
    """The F16 target's 30 layers over this process (blocks 0-10) and both workers (blocks
    11-29 and the output layer), the draft kept local: the same greedy text as everything
    local."""
    base = ("run", "-m", f16, "-md", q4_1, "-p", PROMPT, "-n", "48", "--temp", "0",
            "-t", "1", "-c", "512")
    local = specli(*base)
    assert local.returncode == 0, local.stderr
    before = [w.clients() for w in workers]
    r = specli(*base, "--rpc", ",".join(w.endpoint for w in workers), "-ngl", "20",
               "-ts", "1,1", "-devd", "none", "-v")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == local.stdout
    assert re.search(r"layer +10 assigned to device CPU", r.stderr)
    assert re.search(r"layer +11 assigned to device RPC0", r.stderr)
    assert re.search(r"layer +29 assigned to device RPC1", r.stderr)
    assert all(a > b for a, b in zip((w.clients() for w in workers), before, strict=True))


@needs_rpc
def test_rpc_with_no_offloaded_layer_warns(workers, f16):
    r = specli("run", "-m", f16, "-p", "hi", "-n", "2", "--rpc", workers[0].endpoint,
               "-c", "256")
    assert r.returncode == 0, r.stderr
    assert "warning: --rpc with -ngl 0 offloads no layer" in r.stderr


@needs_rpc
def test_check_pair_probe_over_a_worker(workers, f16, q4_1):
    before = workers[1].clients()
    r = specli("check-pair", f16, q4_1, "--probe", "-n", "8", "--rpc", workers[1].endpoint,
               "-ngl", "99", "-devd", "none", "--json")
    assert r.returncode == 0, r.stderr
    assert '"probe": {' in r.stdout
    assert workers[1].clients() > before


@needs_rpc
def test_serve_over_workers_answers_the_openai_client(workers, f16):
    local = specli("run", "-m", f16, "-p", "The capital of France is", "-n", "12", "--temp", "0",
                   "-c", "512", "--no-spec")
    s = Server("-m", f16, "--rpc", ",".join(w.endpoint for w in workers), "-ngl", "99",
               "-ts", "1,1", "-c", "512", "--temp", "0")
    try:
        c = s.client()
        r = c.completions.create(model="x", prompt="The capital of France is", max_tokens=12,
                                 temperature=0)
        assert r.choices[0].text == local.stdout.rstrip("\n")
        assert httpx.get(f"{s.url}/health", verify=False).json()["status"] == "ok"
    finally:
        s.stop()


# -- a worker lost ---------------------------------------------------------------------------

def _first_output(proc: subprocess.Popen, timeout: float = 120) -> None:
    got = threading.Event()

    def read() -> None:
        if proc.stdout.read(1):
            got.set()
        proc.stdout.read()

    threading.Thread(target=read, daemon=True).start()
    assert got.wait(timeout), "no text came out"


@needs_rpc
def test_a_worker_killed_mid_run_is_exit_2_naming_it_within_10_s(tmp_path, workers, f16):
    doomed = Worker(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "specli", "run", "-m", f16, "-p", PROMPT, "-n", "2000",
         "-c", "2200", "-t", "1", *NO_EOS, "--rpc", f"{workers[0].endpoint},{doomed.endpoint}",
         "-ngl", "99", "-ts", "1,1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _first_output(proc)
        doomed.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rc = proc.wait(30)
        took = time.monotonic() - t0
        err = proc.stderr.read()
    finally:
        proc.kill()
        doomed.kill()
    assert rc == 2, err
    assert took < 10
    # refused between two calls; reset by peer when the kill lands in the middle of one
    assert re.search(rf"error: the RPC server {re.escape(doomed.endpoint)} is gone "
                     r"\(connection (refused|reset by peer)\)", err), err
    assert "Traceback" not in err and "GGML_ABORT" not in err and "ggml-rpc.cpp" not in err


@needs_rpc
def test_serve_a_lost_worker_is_503_then_back_when_it_is(tmp_path, workers, f16):
    """The requests in flight get 503 (a stream: its error event), so does /health (naming
    the worker); once the worker is back the server starts over in place and answers
    again."""
    doomed = Worker(tmp_path)
    s = Server("-m", f16, "--rpc", f"{workers[1].endpoint},{doomed.endpoint}", "-ngl", "99",
               "-ts", "1,1", "-c", "4400", "-np", "2", "-t", "1", "--temp", "0")
    try:
        h = s.http(key=None)
        answer: dict = {}
        body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}

        def long_request() -> None:
            r = h.post("/v1/completions", json=body)
            answer.update(status=r.status_code, body=r.json())

        def long_stream() -> None:
            with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                answer["stream"] = [line for line in r.iter_lines() if line]

        threads = [threading.Thread(target=long_request), threading.Thread(target=long_stream)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while h.get("/health").json().get("slots_processing") != 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1)
        doomed.proc.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert answer.get("status") == 503, answer
        assert doomed.endpoint in answer["body"]["error"]["message"]
        last = json.loads(answer["stream"][-1].removeprefix("data: "))
        assert last["error"]["type"] == "unavailable_error", answer["stream"][-3:]
        assert doomed.endpoint in last["error"]["message"]
        health = h.get("/health")
        assert health.status_code == 503
        assert f"the RPC server {doomed.endpoint} is gone" in health.json()["error"]["message"]
        assert h.post("/v1/completions", json={"prompt": "hi"}).status_code == 503
        doomed.kill()
        doomed = Worker(tmp_path, port=doomed.port)  # back, same address
        deadline = time.monotonic() + 120
        while True:
            try:
                if h.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass  # between the old image and the new one listening
            assert time.monotonic() < deadline, "the server did not come back"
            time.sleep(0.5)
        r = s.client().completions.create(model="x", prompt="The capital of France is",
                                          max_tokens=4, temperature=0)
        assert r.choices[0].text
    finally:
        s.stop()
        doomed.kill()


def test_tune_drafts_best_command_keeps_the_placement():
    """tune-draft measured with --rpc, -ngl and -devd: its best command must run the same way."""
    from specli.cli import options as o

    gpu = o.GPU_FLAGS.parse(rpc_servers="10.0.0.1:50052,10.0.0.2:50052", device_draft="none",
                       tensor_split="3,1", override_tensor=["a=CPU"])
    res = o.Resources(ngl=99)
    args = o.placement_args(res, gpu)
    assert args == ["-ngl", "99", "--rpc", "10.0.0.1:50052,10.0.0.2:50052", "-devd", "none",
                    "-ts", "3,1", "-ot", "a=CPU"]
    assert o.placement_args(o.Resources(), o.GPU_FLAGS.parse()) == []


@needs_rpc
def test_the_workers_connections_get_keepalive(workers, f16):
    """llama.cpp sets no keepalive: a worker whose machine vanishes would never be noticed.
    In a child process (RPC devices, once added, stay for the process's life)."""
    code = f"""
import socket, os
from specli import rpc
from specli.backend import Model
from specli.config import ModelParams
m = Model(ModelParams({f16!r}, n_ctx=64, n_threads=1, rpc=({workers[0].endpoint!r},),
                      n_gpu_layers=99))
conns = rpc._connections([{workers[0].endpoint!r}])
assert conns
for _, fd in conns:
    with socket.socket(fileno=os.dup(fd)) as s:
        print(s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
              s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
              s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))
m.close()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == "1 5 20000"
