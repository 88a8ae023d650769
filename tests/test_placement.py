"""Where users run specli (issue 14): llama.cpp's libraries load first, every flag reads its
llama.cpp environment variable, the GPU placement flags on this CPU build, and timing buckets
that add up to the wall time."""

from __future__ import annotations

import enum
import inspect
import json
import os
import re
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
from conftest import PROMPTS, cli, specli
from typer.main import get_command

from specli import backend
from specli.cli import options as o
from specli.cli.app import app
from specli.config import DraftParams, ModelParams, SamplingParams
from specli.plan import load
from specli.stats import Stats

CLI = get_command(app)
COMMANDS = ["run", "serve", "tune-draft", "audit", "check-pair"]

# -- 1. load order -------------------------------------------------------------------------

FAKE_SENTENCEPIECE = """
import os, sys
maps = open("/proc/self/maps").read()
with open(os.environ["SPM_RECORD"], "a") as f:
    f.write(f"{'llama_cpp' in sys.modules} {'libllama' in maps}\\n")
class SentencePieceProcessor:
    pass
"""


@pytest.fixture
def fake_sentencepiece(tmp_path, monkeypatch):
    (tmp_path / "sentencepiece.py").write_text(FAKE_SENTENCEPIECE)
    record = tmp_path / "record.txt"
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
           "SPM_RECORD": str(record)}
    return env, record


def test_llama_cpp_loads_before_sentencepiece_in_a_library_user(fake_sentencepiece, q4_1):
    """A program that uses the engine imports specli.backend (or specli.Engine) first, as the
    entry point does: `import specli` itself loads nothing (issue 58)."""
    env, record = fake_sentencepiece
    code = ("import specli.backend, specli.cli.app, gguf\n"
            "from specli.cli import run, serve, tune, audit, check_pair, download, info, lookup\n"
            "from specli.backend import Model\nfrom specli.config import ModelParams\n"
            f"Model(ModelParams({q4_1!r}, n_ctx=64)).close()\nprint('loaded')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=120)
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr
    # the fake was imported (gguf imports sentencepiece), after llama.cpp's libraries
    assert record.read_text().split() == ["True", "True"]


def test_llama_cpp_loads_before_sentencepiece_in_the_cli(fake_sentencepiece, f16, q4_1):
    env, record = fake_sentencepiece
    r = specli("run", "-m", f16, "-md", q4_1, "-p", "Hi", "-n", "4", "--temp", "0", "--json",
               env=env)  # a fresh process: the order of its imports is the point
    assert r.returncode == 0, r.stderr
    # `run -m` reads the headers with gguf's type tables alone (ggufmeta.gguf_constants):
    # gguf's package, and sentencepiece under it, need not load at all; if they do, after
    # llama.cpp's libraries
    lines = record.read_text().split() if record.exists() else []
    assert lines in ([], ["True", "True"]), lines


def test_a_header_read_leaves_gguf_unimported_and_whole_afterwards(q4_1):
    """ggufmeta reads with gguf's type tables alone (no package, no sentencepiece); a later
    `import gguf` in the same process is the whole package, `gguf.constants` included."""
    code = ("import sys\nfrom specli.ggufmeta import read_header\n"
            f"read_header({q4_1!r})\nprint(sorted(m for m in sys.modules if 'gguf' in m"
            " and not m.startswith('specli')))\n"
            "import gguf\n"
            "print(gguf.constants.GGUFValueType.ARRAY.name, gguf.GGUFWriter.__name__)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[]", "ARRAY GGUFWriter"]


def test_the_fake_would_catch_the_wrong_order(fake_sentencepiece):
    """The check above can fail: gguf imported on its own, or after `import specli` (which
    loads nothing), records llama.cpp as absent."""
    env, record = fake_sentencepiece
    subprocess.run([sys.executable, "-c", "import specli, gguf"], env={**os.environ, **env},
                   check=True, timeout=60)
    assert record.read_text().split() == ["False", "False"]


# -- 4. environment variables --------------------------------------------------------------

def _env_options():
    for name in COMMANDS:
        for p in CLI.commands[name].params:  # Typer's own click: no isinstance checks
            if p.param_type_name == "option" and p.envvar:
                for env in [p.envvar] if isinstance(p.envvar, str) else p.envvar:
                    yield pytest.param(name, p.name, env, id=f"{name}-{env}")


def _samples(command: str, p) -> tuple[str, object, list[str], object]:
    """(env text, the value it parses to, command-line args, the value they parse to), from
    the parameter's Python type in the command's signature."""
    annotation = inspect.signature(CLI.commands[command].callback).parameters[p.name].annotation
    kind = next(t for t in typing.get_args(typing.get_args(annotation)[0]) or
                [typing.get_args(annotation)[0]] if t is not type(None))
    flag = p.opts[0]
    if kind is bool:
        return "1", True, [flag], True
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        a, b = (m.value for m in list(kind)[:2])
        return a, a, [flag, b], b
    if kind is int:
        return "3", 3, [flag, "5"], 5
    if kind is float:
        return "0.25", 0.25, [flag, "0.5"], 0.5
    if typing.get_origin(kind) is list:
        return "envkey", ["envkey"], [flag, "clikey"], ["clikey"]
    return "from-env", "from-env", [flag, "from-cli"], "from-cli"


def _parse(command: str, args: list[str]) -> dict:
    cmd = CLI.commands[command]
    extra = ["t.gguf", "d.gguf"] if command == "check-pair" else []
    with cmd.make_context(command, [*extra, *args]) as ctx:
        return ctx.params


def _norm(v):
    if isinstance(v, tuple | list):
        return [_norm(x) for x in v]
    if isinstance(v, enum.Enum):
        return v.value
    return str(v) if isinstance(v, Path) else v


@pytest.mark.parametrize("command, param, env", list(_env_options()))
def test_every_environment_variable_arrives_and_the_flag_wins(command, param, env,
                                                              monkeypatch):
    p = next(x for x in CLI.commands[command].params if x.name == param)
    for other in [p.envvar] if isinstance(p.envvar, str) else p.envvar:
        monkeypatch.delenv(other, raising=False)
    text, value, args, cli_value = _samples(command, p)
    monkeypatch.setenv(env, text)
    assert _norm(_parse(command, [])[param]) == value
    assert _norm(_parse(command, args)[param]) == cli_value


def test_the_environment_covers_what_llama_cpp_binds():
    """Every flag llama.cpp's common/arg.cpp binds to a variable reads it here too (checked
    against the vendored source when build_native.sh has unpacked it)."""
    base = os.environ.get("SPECLI_NATIVE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specli", "native")
    found = sorted(Path(base).glob("llama_cpp_python-*/vendor/llama.cpp/common/arg.cpp"))
    if not found:
        pytest.skip("no vendored llama.cpp source (scripts/build_native.sh unpacks it)")
    src = found[-1].read_text()
    bound: dict[str, str] = {}
    for m in re.finditer(r'\.set_env\("([A-Z_0-9]+)"\)', src):
        block = src[src.rfind("add_opt(common_arg(", 0, m.start()):m.start()]
        flags = re.search(r"\{([^}]*)\}", block).group(1)
        for flag in re.findall(r'"([^"]+)"', flags):
            bound[flag] = m.group(1)
    # flags spelled as llama.cpp's but meaning something else here: sweep and probe settings
    other_meaning = {("tune-draft", "-n"), ("tune-draft", "--draft"),
                     ("tune-draft", "--draft-p-min"), ("tune-draft", "--spec-type"),
                     ("tune-draft", "--draft-n-seq"), ("tune-draft", "--draft-p-split"),
                     ("check-pair", "-n"), ("check-pair", "--draft")}
    missing = []
    for name in COMMANDS:
        for p in CLI.commands[name].params:
            if p.param_type_name != "option" or (name, p.opts[0]) in other_meaning:
                continue
            ours = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar or [])
            for flag in p.opts:
                if flag in bound and bound[flag] not in ours:
                    missing.append(f"{name} {flag}: {bound[flag]}")
    assert not missing, missing


def test_a_container_serves_from_the_environment_alone(q4_1, tmp_path):
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LLAMA_ARG_MODEL": q4_1, "LLAMA_ARG_HOST": "127.0.0.1",
           "LLAMA_ARG_PORT": str(port), "LLAMA_API_KEY": "k1", "LLAMA_ARG_CTX_SIZE": "512",
           "LLAMA_ARG_N_PARALLEL": "2", "LLAMA_ARG_ALIAS": "from-env", "LLAMA_ARG_THREADS": "2"}
    proc = subprocess.Popen([sys.executable, "-m", "specli", "serve"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", verify=False,
                             timeout=5).status_code == 200:
                    break  # loaded (503 while loading, as llama-server)
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", verify=False,
                      headers={"Authorization": "Bearer k1"}, timeout=5)
        assert r.json()["data"][0]["id"] == "from-env"
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", verify=False,
                         timeout=5).status_code == 401
        props = httpx.get(f"http://127.0.0.1:{port}/props", verify=False,
                          headers={"Authorization": "Bearer k1"}, timeout=5).json()
        assert props["total_slots"] == 2, props
    finally:
        proc.terminate()
        proc.wait(30)


def test_help_shows_the_variables():
    r = cli("run", "--help", env={"COLUMNS": "200"})
    for env in ("LLAMA_ARG_MODEL", "LLAMA_ARG_CTX_SIZE", "LLAMA_ARG_N_GPU_LAYERS",
                "LLAMA_ARG_DEVICE", "LLAMA_ARG_SPEC_DRAFT_N_MAX"):
        assert env in r.stdout


# -- 3. GPU placement flags on this CPU build -----------------------------------------------

def one_line_error(r, *needles: str) -> None:
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_list_devices_shows_the_cpu(command):
    args = ["t.gguf", "d.gguf"] if command == "check-pair" else []
    r = cli(command, *args, "--list-devices")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Available devices:")
    assert re.search(r"^  CPU: .+ \(CPU, \d+ MiB, \d+ MiB free\)$", r.stdout, re.M)


@pytest.mark.parametrize("command", ["run", "serve", "tune-draft", "audit"])
def test_a_missing_device_is_one_line(command, f16, q4_1):
    r = cli(command, "-m", f16, "-md", q4_1, "-dev", "NoSuchDev9", "-n", "4")
    one_line_error(r, "no offload device 'NoSuchDev9'", "--list-devices")


def test_a_missing_draft_device_in_the_probe_is_one_line(f16, q4_1):
    r = cli("check-pair", f16, q4_1, "--probe", "-devd", "Vulkan3")
    one_line_error(r, "'Vulkan3'")


@pytest.mark.parametrize("args, needle", [
    (["-ts", "3,x"], "-ts/--tensor-split"),
    (["-ts", "-1,2"], "-ts/--tensor-split"),
    (["-ts", "0,0"], "not all 0"),
    (["-sm", "diagonal"], "-sm/--split-mode"),
    (["-ot", "blk"], "PATTERN=BUFFER_TYPE"),
    (["-ot", "blk(=CPU"], "not a regular expression"),
    (["-ot", "blk=VRAM"], "unknown buffer type 'VRAM'"),
    (["-ncmoe", "-2"], "-ncmoe"),
    (["-dev", "a,,b"], "-dev/--device"),
])
def test_placement_values_are_checked(args, needle, f16):
    one_line_error(cli("run", "-m", f16, "-n", "4", *args), needle)


def test_cpu_placement_runs_and_keeps_the_output(f16, q4_1):
    """-dev none, -sm none, -ts and overrides into the CPU buffer type change nothing here."""
    base = ["-m", f16, "-md", q4_1, "-p", PROMPTS[0], "-n", "24", "--temp", "0",
            "--json"]
    plain = cli("run", *base)
    placed = cli("run", *base, "-dev", "none", "-devd", "none", "-sm", "none", "-ts", "1",
                    "-mg", "0", "-ot", r"blk\.0\..*=CPU", "-cmoe", "-ncmoed", "2")
    assert plain.returncode == placed.returncode == 0, placed.stderr
    assert json.loads(placed.stdout)["text"] == json.loads(plain.stdout)["text"]


def test_the_draft_follows_the_target_as_llama_cpp_does():
    gpu = o.GPU_FLAGS.parse(device="CUDA0,CUDA1", device_draft=None, split_mode="row",
                       tensor_split="3/1", override_tensor=[r"a=CPU,b=CUDA1"], n_cpu_moe=1,
                       cpu_moe_draft=True)
    t, d = o.Resources().model_params("t.gguf", "d.gguf", gpu=gpu)
    assert t.devices == d.devices == ("CUDA0", "CUDA1")
    assert t.split_mode == d.split_mode == "row" and d.tensor_split == (3.0, 1.0)
    assert t.tensor_overrides == (("a", "CPU"), ("b", "CUDA1"),
                                  (r"blk\.0" + o.FFN_EXPS_REGEX, "CPU"))
    assert d.tensor_overrides == ((o.FFN_EXPS_REGEX, "CPU"),)  # -ot is the target's alone
    pinned = o.GPU_FLAGS.parse(device="CUDA0,CUDA1", device_draft="CUDA1", split_mode="row")
    t, d = o.Resources().model_params("t.gguf", "d.gguf", gpu=pinned)
    assert d.devices == ("CUDA1",) and d.split_mode == "layer" and t.split_mode == "row"
    assert o.GPU_FLAGS.parse(device="none").devices == ()


def test_devices_in_process():
    devices = backend.list_devices()
    assert any(d.type == "CPU" for d in devices)
    assert backend.supports_gpu_offload() == (any(d.type in ("GPU", "IGPU") for d in devices)
                                              or backend.rpc_available())
    backend.check_placement(ModelParams("x.gguf", devices=(), tensor_overrides=(("a", "CPU"),)))


# -- 2. timing buckets ------------------------------------------------------------------------

def test_eval_times_and_overhead_add_up_to_the_wall_time(f16, q4_1):
    e = load(ModelParams(f16, n_ctx=1024),
                    ModelParams(q4_1, n_ctx=1024), DraftParams(n_max=6))
    try:
        ids = e.tokenize(PROMPTS[0], chat=True)
        stats = Stats()
        t0 = time.perf_counter()
        n = sum(1 for _ in e.steps(ids, 64, SamplingParams(temp=0), stats))
        wall = time.perf_counter() - t0
    finally:
        e.close()
    assert n == stats.n_predict > 0
    inside = stats.t_target_decode_s + stats.t_draft_decode_s
    assert inside <= stats.t_decode_s  # never more than the wall: overhead is not clamped
    total = stats.target.eval_ms + stats.draft.eval_ms + 1e3 * stats.overhead_s
    assert total == pytest.approx(1e3 * stats.t_decode_s, rel=0.02)
    # and the buckets cover what a clock outside the engine saw
    assert stats.t_encode_s + stats.t_decode_s == pytest.approx(wall, rel=0.02)


def test_the_wait_for_the_device_lands_in_the_model_bucket(f16, monkeypatch):
    """On a GPU llama_decode returns early and llama_synchronize waits: that wait must count
    as the model's eval time, not as overhead. A synchronize that sleeps stands in for it."""
    real = backend.ll.llama_synchronize
    delay, calls = 0.004, []

    def slow_sync(ctx):
        calls.append(1)
        time.sleep(delay)
        real(ctx)

    e = load(ModelParams(f16, n_ctx=512))
    try:
        ids = e.tokenize(PROMPTS[1])
        monkeypatch.setattr(backend.ll, "llama_synchronize", slow_sync)
        stats = Stats()
        list(e.steps(ids, 16, SamplingParams(temp=0), stats))
    finally:
        e.close()
    assert stats.target.eval_runs >= 16 and calls
    assert stats.t_target_decode_s >= stats.target.eval_runs * delay
    assert stats.overhead_s < stats.target.eval_runs * delay / 2


def test_an_offloaded_draft_decodes_one_token_at_a_time(f16, q4_1):
    """On a GPU (Model.offloaded) the draft never decodes a 2-token batch (each new batch shape
    costs a CUDA graph capture), and the output is still the target's."""
    def generate(offloaded: bool) -> tuple[list[int], list[int]]:
        e = load(ModelParams(f16, n_ctx=1024),
                        ModelParams(q4_1, n_ctx=1024), DraftParams(n_max=4))
        try:
            dm = e.draft_model
            dm.offloaded = offloaded
            sizes, decode = [], dm.decode

            def record(tokens, logits="last"):
                sizes.append(len(tokens))
                return decode(tokens, logits)

            dm.decode = record
            ids = e.tokenize(PROMPTS[4], chat=True)
            return e.complete(ids, 48, SamplingParams(temp=0)).tokens, sizes[1:]  # [0]: prompt
        finally:
            e.close()

    (cpu, cpu_sizes), (gpu, gpu_sizes) = generate(False), generate(True)
    assert cpu == gpu
    assert 2 in cpu_sizes  # after a full acceptance the CPU feeds two tokens at once
    assert set(gpu_sizes) == {1}
