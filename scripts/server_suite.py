"""Run llama.cpp's own server test suite against `specli serve` and native llama-server, on
the same local models, and compare which tests pass.

    python scripts/server_suite.py --model F16.gguf --draft Q4_1.gguf [--server both]
        [--native-bin DIR] [--files test_chat_completion.py ...] [-k EXPR] [--json OUT]

The suite (tools/server/tests in the llama.cpp tree that llama-cpp-python vendors) starts a
server per test with llama-server's flags and models from the Hugging Face Hub. Here a thin
wrapper stands in for the server binary: it replaces the Hub flags with the local --model
(and --draft for the suite's draft downloads), and for specli drops the llama-server flags
specli does not have (listed in DROP, each reported); nothing else is changed, so a test
that asserts on the suite's own tiny models' text fails on both servers alike. The suite's
Python requirements (aiohttp, filelock, wget, prometheus-client, requests) must be
installed. Native llama-server: SPECLI_NATIVE_SERVER=1 scripts/build_native.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ["test_chat_completion.py", "test_completion.py", "test_tokenize.py",
         "test_speculative.py", "test_security.py", "test_ctx_shift.py", "test_template.py",
         "test_tool_call.py", "test_compat_anthropic.py", "test_compat_oai_responses.py"]

# llama-server flags specli serve does not have, with how many values each takes
DROP = {"--hf-repo": 1, "--hf-file": 1, "--model-url": 1, "--offline": 0, "--no-ui": 0,
        "--cont-batching": 0, "--kv-unified": 0,
        "--swa-full": 0,
        "--reasoning-budget": 1, "--reasoning-budget-message": 1,
        "--spec-synth-len": 1, "--spec-synth-rates": 1, "--slot-save-path": 1,
        "--grp-attn-n": 1, "--grp-attn-w": 1, "--cache-ram": 1, "--no-cache-idle-slots": 0,
        "--sleep-idle-seconds": 1, "--models-dir": 1, "--models-max": 1,
        "--models-preset": 1, "--no-models-autoload": 0, "--pooling": 1,
        "--embedding": 0, "--reranking": 0, "--mmproj-url": 1, "--no-mmproj": 0,
        "--media-path": 1,
        "--backend_sampling": 0, "--ui-mcp-proxy": 0, "--tools": 1, "--tools-runtime": 1,
        "--mcp-servers-config": 1, "--mcp-servers-json": 1, "--lora": 1}
HUB = {"--hf-repo": 1, "--hf-file": 1, "--model-url": 1, "--offline": 0}

WRAPPER = '''#!{python}
"""Stand-in for llama-server: local models for the Hub's, then exec the real server."""
import json, os, sys
cfg = json.loads({cfg!r})
args, out, dropped, i = sys.argv[1:], [], [], 0
while i < len(args):
    a = args[i]
    n = cfg["drop"].get(a)
    if n is not None:
        dropped.append(" ".join(args[i:i + 1 + n]))
        i += 1 + n
        continue
    out.append(a)
    i += 1
if "--model" not in out and "-m" not in out:
    out += ["--model", cfg["model"]]
with open(cfg["log"], "a") as f:
    f.write(json.dumps({{"args": out, "dropped": dropped}}) + "\\n")
os.execv(cfg["argv"][0], [*cfg["argv"], *out])
'''

PLUGIN = '''"""Keep the suite off the Hub: local presets, the local draft for downloads."""
import os, sys
sys.path.insert(0, os.environ["SUITE_DIR"])
import utils  # noqa: E402
utils.ServerPreset.load_all = staticmethod(lambda: None)
utils.download_file = lambda url, *a, **k: os.environ["SUITE_DRAFT"]
'''


def suite_dir() -> Path:
    import importlib.metadata as md

    version = md.version("llama-cpp-python")
    cache = Path(os.environ.get("SPECLI_NATIVE_DIR", Path.home() / ".cache/specli/native"))
    d = cache / f"llama_cpp_python-{version}/vendor/llama.cpp/tools/server/tests"
    if not d.is_dir():
        sys.exit(f"error: no server tests at {d}: run scripts/build_native.sh first")
    return d


def run(server: str, args, work: Path) -> dict:
    # the suite's own layout: tests/ three levels below the tree whose models/templates/
    # its template tests name (../../../models/templates/NAME.jinja)
    tree = work / f"tree-{server}"
    tests = tree / "tools" / "server" / "tests"
    shutil.copytree(suite_dir(), tests)
    (tree / "models").symlink_to(suite_dir().parents[2] / "models")
    (tests / "specli_suite_plugin.py").write_text(PLUGIN)
    if server == "specli":
        argv = [sys.executable, "-m", "specli", "serve"]
        drop = DROP
    else:
        argv = [str(Path(args.native_bin) / "llama-server")]
        drop = HUB
    log = work / f"{server}-args.jsonl"
    cfg = {"argv": argv, "model": str(Path(args.model).resolve()), "drop": drop,
           "log": str(log)}
    wrapper = work / f"{server}-server"
    wrapper.write_text(WRAPPER.format(python=sys.executable, cfg=json.dumps(cfg)))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    xml = work / f"{server}.xml"
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(wrapper), "SUITE_DIR": str(tests),
           "SUITE_DRAFT": str(Path(args.draft).resolve()), "PYTHONPATH": os.pathsep.join(
               [str(tests), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "LLAMA_CACHE": str(work / "cache")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "specli_suite_plugin", "-p",
           "no:cacheprovider", f"--junitxml={xml}", *[f"unit/{f}" for f in args.files]]
    if args.k:
        cmd += ["-k", args.k]
    print(f"{server}: {' '.join(cmd[3:])}", file=sys.stderr)
    subprocess.run(cmd, cwd=tests, env=env, timeout=args.timeout)
    results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        skipped = case.find("skipped")
        results[name] = ("skipped" if skipped is not None else "failed" if bad is not None
                         else "passed", (bad.get("message") or "")[:300] if bad is not None
                         else "")
    dropped = sorted({d for line in log.read_text().splitlines()
                      for d in json.loads(line)["dropped"]}) if log.exists() else []
    return {"results": results, "dropped": dropped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the GGUF both servers load")
    ap.add_argument("--draft", required=True, help="the draft GGUF for the suite's drafts")
    ap.add_argument("--server", choices=["specli", "native", "both"], default="both")
    ap.add_argument("--native-bin", default=str(Path.home() / ".cache/specli/native/"
                                                 "llama.cpp-0.3.36/bin"))
    ap.add_argument("--files", nargs="+", default=FILES)
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", default=None, help="write every test's outcome here")
    args = ap.parse_args()
    servers = ["specli", "native"] if args.server == "both" else [args.server]
    with tempfile.TemporaryDirectory(prefix="specli-suite-") as tmp:
        out = {s: run(s, args, Path(tmp)) for s in servers}
    names = sorted({n for r in out.values() for n in r["results"]})
    print(f"\n| test | {' | '.join(servers)} |\n|---|{'---|' * len(servers)}")
    for n in names:
        print(f"| {n} | " + " | ".join(out[s]["results"].get(n, ("-",))[0]
                                       for s in servers) + " |")
    for s in servers:
        res = out[s]["results"].values()
        print(f"\n{s}: {sum(r[0] == 'passed' for r in res)} passed of {len(res)}"
              f"; flags dropped: {', '.join(out[s]['dropped']) or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
