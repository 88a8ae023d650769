"""What a llama.cpp user meets in the first hour (issue 34): the version and the help without
llama.cpp's libraries, ..."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import cli

PROBE = ("import sys; sys.argv = ['specli', *sys.argv[1:]]; import specli.__main__ as m\n"
         "try:\n    m.main()\nexcept SystemExit:\n    pass\n"
         "print(sorted({'llama_cpp', 'gguf', 'numpy'} & set(sys.modules)), file=sys.stderr)")


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["run", "--help"],
                                  ["lookup", "--help"], ["serve", "-h"]])
def test_version_and_help_load_no_llama_library(args):
    """llama.cpp's --version and --help are instant; specli's load no model library either
    (libllama and its backends were most of a second), nor gguf, nor numpy (0.3 s together:
    --help went from 0.59 s to 0.30 s without them)."""
    r = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "printed nothing"
    assert r.stderr.strip().splitlines()[-1] == "[]", r.stderr


def test_a_run_loads_no_high_level_llama_cpp_and_a_later_import_keeps_it_quiet(q4_1):
    """specli uses llama-cpp-python's ctypes API only: its Llama class (numpy, jinja2,
    diskcache, multiprocessing; 0.1 s of every start) is not imported. A program that imports
    it later in the same process gets it whole (from several threads at once: each waits for
    the package's __init__), and llama.cpp's log stays specli's (silent)."""
    code = ("import sys, threading\nfrom specli.backend import Model\nfrom specli.config import "
            "ModelParams\nprint('llama_cpp.llama' in sys.modules)\nimport llama_cpp\n"
            "got = []\nts = [threading.Thread(target=lambda: got.append(llama_cpp.Llama)) "
            "for _ in range(4)]\n[t.start() for t in ts]\n[t.join() for t in ts]\n"
            "print(len(got), got[0].__name__)\n"
            f"Model(ModelParams({q4_1!r}, n_ctx=64)).close()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "4", "Llama"]
    assert r.stderr == ""


@pytest.mark.parametrize("env,args,says", [
    ({"LLAMA_ARG_CTX_SIZE": "abc"}, [], "invalid value for LLAMA_ARG_CTX_SIZE (-c/--ctx-size)"),
    ({"LLAMA_ARG_CTX_SIZE": "-5"}, [], "LLAMA_ARG_CTX_SIZE (-c/--ctx-size) must be at least 16"),
    ({"LLAMA_ARG_FLASH_ATTN": "maybe"}, [], "invalid value for LLAMA_ARG_FLASH_ATTN (-fa/"),
    ({"LLAMA_ARG_CTX_SIZE": "4096"}, ["-c", "-5"], "-c/--ctx-size must be at least 16"),
])
def test_a_bad_value_names_where_it_came_from(env, args, says):
    """A value from an environment variable is named as that variable, not as a flag the user
    never typed; a typed flag keeps its own name."""
    r = cli("run", "-n", "1", *args, env=env)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {says}"), r.stderr


def _on_a_terminal(args: list[str], env: dict) -> bytes:
    """What `specli ARGS` writes to a terminal (a pseudo-terminal for stdout and stderr)."""
    import os
    import pty

    main, sub = pty.openpty()
    try:
        p = subprocess.Popen([sys.executable, "-m", "specli", *args], stdout=sub, stderr=sub,
                             env={**os.environ, "COLUMNS": "120", **env})
        os.close(sub)
        chunks = []
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal's other end closed: all read
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert p.wait(timeout=60) == 0
    finally:
        os.close(main)
    return b"".join(chunks)


def test_no_color_on_a_terminal_is_plain_text(q4_1):
    """NO_COLOR: no escapes at all on a terminal, bold and dim included (no-color.org)."""
    styled = _on_a_terminal(["check-pair", q4_1, q4_1], {})
    assert b"\x1b[" in styled  # a terminal gets styles otherwise
    plain = _on_a_terminal(["check-pair", q4_1, q4_1], {"NO_COLOR": "1"})
    assert b"verdict" in plain and b"\x1b" not in plain


@pytest.mark.parametrize("sig,quiet", [("SIGTERM", False), ("SIGINT", True)])
def test_serve_logs_each_request_and_exits_0_after_a_clean_shutdown(q4_1, sig, quiet):
    """As llama-server: one line on stderr per request with its timings (none with
    --log-disable), and a supervisor's SIGTERM or a Ctrl-C ends it with exit 0 (not 143 or
    130, the signal raised again)."""
    import signal
    import time

    import httpx
    from test_serve import Server

    s = Server("-m", q4_1, "-c", "256", *(["--log-disable"] if quiet else []))
    try:
        r = httpx.post(f"{s.url}/completion", verify=False, json={"prompt": "Hi", "n_predict": 3},
                       timeout=60)
        assert r.status_code == 200, r.text
        t0 = time.monotonic()
        while not quiet and not any("generated 3 tokens" in x for x in s.log):
            assert time.monotonic() - t0 < 10, s.log
            time.sleep(0.05)
        s.proc.send_signal(getattr(signal, sig))
        assert s.proc.wait(20) == 0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    lines = [x for x in s.log if "generated" in x]
    if quiet:
        assert not lines
    else:
        assert len(lines) == 1 and "specli serve: prompt " in lines[0]
        assert "finish length" in lines[0] and " 0.0 t/s" not in lines[0], lines[0]
        assert "steps 0 drafted, 3 plain" in lines[0], lines[0]  # no draft: all plain


def test_what_llama_cpp_changed_is_said(f16, q4_1):
    """Values that passed silently: the context llama.cpp padded, -ngl with no GPU to take
    the layers, a --draft longer than the context; and one out of range is refused."""
    from specli.backend import local_gpu

    r = cli("run", "-m", f16, "-md", q4_1, "-c", "32", "--draft", "100000", "-ngl", "99",
            "-n", "2", "-p", "hi", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "note: -c 32 became 256 (llama.cpp pads the context" in r.stderr
    assert "note: --draft 100000 is more than the 256-token context can verify" in r.stderr
    if not local_gpu():
        assert "warning: no usable GPU found, -ngl 99 is ignored" in r.stderr
        r = cli("run", "-m", f16, "-ngl", "all", "-n", "1", "-p", "hi", "--temp", "0")
        assert r.returncode == 0 and "-ngl all is ignored" in r.stderr  # as it was written
    plain = cli("run", "-m", f16, "-c", "256", "-n", "2", "-p", "hi", "--no-spec")
    assert "note: -c" not in plain.stderr and "warning" not in plain.stderr
    r = cli("run", "-m", f16, "--top-p", "2", "-n", "2", "-p", "hi")
    assert r.returncode == 2 and r.stderr.startswith("error: --top-p must be from 0 to 1")


def test_escape_reads_backslashes_as_llama_cpp_does():
    from specli.cli.run import unescape

    assert unescape(r"a\nb\tc\\d\'e\"f\x41\q") == "a\nb\tc\\d'e\"fA\\q"
    assert unescape("trailing\\") == "trailing\\"


def test_ignore_eos_generates_every_token_and_stays_exact(f16, q4_1):
    """--ignore-eos: all -n tokens (a benchmark's fixed count), the target's own text with
    end-of-generation banned, drafted or not; --log-disable: the text alone."""
    args = ["-m", f16, "-p", "Say hi.", "--chat", "-n", "40", "--temp", "0", "--ignore-eos"]
    spec = cli("run", *args, "-md", q4_1, "--json")
    doc = json.loads(spec.stdout)
    assert doc["stats"]["n_predict"] == 40 and doc["stats"]["finish_reason"] == "length"
    plain = cli("run", *args, "--no-spec", "--log-disable")
    assert plain.returncode == 0 and plain.stderr == ""
    assert plain.stdout == doc["text"] + "\n"
    stops = json.loads(cli("run", *args[:-1], "-md", q4_1, "--json").stdout)
    assert stops["stats"]["finish_reason"] == "stop"  # without it, this prompt ends early


def test_run_takes_a_grammar_or_a_json_schema(f16, q4_1, tmp_path):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    base = ["-m", f16, "-md", q4_1, "-p", "Give a JSON object about a cat.", "--chat",
            "-n", "60", "--temp", "0"]
    r = cli("run", *base, "-j", json.dumps(schema), "--json")
    obj = json.loads(json.loads(r.stdout)["text"])
    assert isinstance(obj["name"], str) and isinstance(obj["age"], int)
    g = tmp_path / "yes.gbnf"
    g.write_text('root ::= "yes" | "no"\n')
    r = cli("run", *base, "--grammar-file", str(g), "--json")
    assert json.loads(r.stdout)["text"] in ("yes", "no")
    r = cli("run", *base, "--grammar", 'root ::= "a"', "-j", "{}")
    assert r.returncode == 2 and "give one of --grammar and -j/--json-schema" in r.stderr


def test_load_modes_and_layer_counts_as_llama_cpp_takes_them(f16):
    """--no-mmap and --mlock reach llama.cpp's load mode (its log says which); -ngl takes a
    number, all or auto, and nothing else."""
    from specli.backend import local_gpu

    for flags, mode in ((["--no-mmap"], "none"), (["--mlock"], "mmap+mlock"),
                        (["--no-mmap", "--mlock"], "mlock"), ([], "mmap")):
        r = cli("run", "-m", f16, *flags, "-n", "1", "-p", "hi", "--no-spec", "-v")
        assert r.returncode == 0 and f"(load_mode = {mode})" in r.stderr, (flags, r.stderr[-500:])
    for value in ("all", "auto", "0"):
        r = cli("run", "-m", f16, "-ngl", value, "-n", "1", "-p", "hi", "--no-spec")
        assert r.returncode == 0, r.stderr
        warned = "no usable GPU found" in r.stderr
        assert warned == (value == "all" and not local_gpu())  # auto: none where no GPU
    r = cli("run", "-m", f16, "-ngl", "some", "-n", "1", "-p", "hi")
    assert r.returncode == 2 and "-ngl takes a number of layers, auto or all" in r.stderr


def test_reverse_prompt_stops_once_it_is_printed(f16, q4_1):
    """-r: the text stops at the token that completes the reverse prompt, which is printed
    (llama.cpp's -r), and the rest is the target's own text up to there."""
    base = ["-m", f16, "-md", q4_1, "-p", "Write a haiku about autumn.", "--chat", "-n", "48",
            "--temp", "0", "--json"]
    full = json.loads(cli("run", *base).stdout)["text"]
    words = full.split()
    rp = " " + words[len(words) // 2]
    assert rp in full
    cut = json.loads(cli("run", *base, "-r", rp, "-r", "never printed").stdout)
    at = full.index(rp) + len(rp)
    assert full.startswith(cut["text"]) and at <= len(cut["text"]) < len(full)
    assert cut["stats"]["finish_reason"] == "stop"


def test_serve_grammar_is_the_default_of_requests_without_one(q4_1):
    """serve --grammar (or -j): what a request that brings no grammar or schema is held to,
    as llama-server's; a request's own grammar wins."""
    import httpx
    from test_serve import Server

    s = Server("-m", q4_1, "-c", "512", "--log-disable", "--grammar", 'root ::= "yes" | "no"')
    try:
        def content(**extra) -> str:
            r = httpx.post(f"{s.url}/completion", verify=False, timeout=60, json={
                "prompt": "Is it?", "n_predict": 8, "temperature": 0, **extra})
            assert r.status_code == 200, r.text
            return r.json()["content"]

        assert content() in ("yes", "no")
        assert content(grammar='root ::= "maybe"') == "maybe"
    finally:
        s.stop()


def test_warmup_is_on_as_llama_cpp_and_changes_no_token(q4_1):
    """llama.cpp decodes once at load (--warmup, the default) so that the first prompt's
    timing is the prompt's; --no-warmup skips it. Either way the cache starts empty: the
    same tokens come out."""
    from specli.backend import Model
    from specli.config import ModelParams

    m = Model(ModelParams(q4_1, n_ctx=128))
    try:
        assert m.tokens == [] and ModelParams(q4_1).warmup
        assert m.decode(m.tokenize("Hi")).shape[-1] == m.n_vocab  # a fresh cache from 0
    finally:
        m.close()
    args = ("run", "-m", q4_1, "-p", "The capital of France is", "-n", "12", "--temp", "0")
    warm, cold = cli(*args), cli(*args, "--no-warmup")
    assert warm.returncode == cold.returncode == 0, cold.stderr
    assert warm.stdout == cold.stdout and warm.stdout.strip()


def test_a_prompt_without_chat_gets_a_note_on_a_terminal_only(f16):
    """-p is continued as text (llama-speculative's default, which scripts compare): a person
    at a terminal is told that --chat answers; a pipe gets no note."""
    import shlex
    import shutil

    if shutil.which("script") is None:
        pytest.skip("util-linux script is not installed")
    args = ["run", "-m", f16, "-p", "Write a binary search in Python", "-n", "2", "--temp", "0"]
    cmd = shlex.join([sys.executable, "-m", "specli", *args])
    r = subprocess.run(["script", "-qec", f"stty cols 200 rows 40; {cmd}", "/dev/null"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TERM": "xterm"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--chat wraps it in the model's chat template" in r.stdout, r.stdout
    piped = cli(*args)
    assert piped.returncode == 0 and "--chat wraps" not in piped.stderr
    chat = subprocess.run(["script", "-qec", f"stty cols 200 rows 40; {cmd} --chat",
                           "/dev/null"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TERM": "xterm"})
    assert chat.returncode == 0 and "--chat wraps" not in chat.stdout
