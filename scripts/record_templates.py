"""Record how native llama-server renders chat templates, for tests/test_templates.py.

    SPECLI_NATIVE_SERVER=1 scripts/build_native.sh
    python scripts/record_templates.py --model SmolLM2-135M-Instruct.F16.gguf

For each template of llama.cpp's models/templates/ (every one: the families specli reads
tool calls of and the rest), start native llama-server with `--jinja --chat-template-file`,
post each of CONVERSATIONS to /apply-template, and write what it answered to
tests/data/templates/native.json, the template files beside it (copied from the vendored
tree: the test needs no llama.cpp source). The date the templates printed is recorded too:
the test puts today's in its place.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "templates"
sys.path.insert(0, str(ROOT / "scripts"))


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = {"id": "call12345", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ASK = {"role": "user", "content": "What is the weather in Paris?"}

# name -> the /apply-template body (messages, and tools, kwargs, add_generation_prompt)
CONVERSATIONS = {
    "plain": {"messages": [{"role": "system", "content": "You are terse."},
                           {"role": "user", "content": "Hello"}]},
    "no_generation_prompt": {"messages": [{"role": "user", "content": "Hello"}],
                             "add_generation_prompt": False},
    "tools": {"messages": [ASK], "tools": [WEATHER]},
    "round_trip": {"messages": [
        ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
         "content": "Sunny, 21 C"}], "tools": [WEATHER]},
    "reasoning_history": {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
        {"role": "user", "content": "Bye"}]},
    "thinking_off": {"messages": [{"role": "user", "content": "Hello"}],
                     "chat_template_kwargs": {"enable_thinking": False}},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())["prompt"]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()).get("error", {}).get("message", "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--native-bin", default=None)
    args = ap.parse_args()
    import native

    bin_dir = Path(args.native_bin) if args.native_bin else native.native_bin_dir()
    if bin_dir is None or not (bin_dir / "llama-server").exists():
        sys.exit("no native llama-server: SPECLI_NATIVE_SERVER=1 scripts/build_native.sh")
    version = importlib.metadata.version("llama-cpp-python")
    src = bin_dir.parent.parent / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp" / \
        "models" / "templates"
    OUT.mkdir(parents=True, exist_ok=True)
    today = datetime.now()
    doc = {"llama_cpp_python": version, "model": Path(args.model).name,
           "date_string": today.strftime("%d %b %Y"), "datetime": today.strftime("%b %d %Y"),
           "conversations": CONVERSATIONS, "renders": {}}
    for name in sorted(p.stem for p in src.glob("*.jinja")):
        shutil.copy(src / f"{name}.jinja", OUT / f"{name}.jinja")
        port = free_port()
        proc = subprocess.Popen(
            [str(bin_dir / "llama-server"), "-m", args.model, "--port", str(port), "-c", "2048",
             "--jinja", "--chat-template-file", str(src / f"{name}.jinja"), "-t", "2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(600):
                if proc.poll() is not None:  # native refused the template: no render
                    break
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.1)
            doc["renders"][name] = {}
            for conv, body in CONVERSATIONS.items():
                status, prompt = post(f"{url}/apply-template", body) if proc.poll() is None \
                    else (0, "llama-server did not start with this template")
                doc["renders"][name][conv] = {"status": status, "prompt": prompt}
            print(f"{name}: {sum(v['status'] == 200 for v in doc['renders'][name].values())}"
                  f"/{len(CONVERSATIONS)} rendered", file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    (OUT / "native.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(OUT / "native.json")


if __name__ == "__main__":
    main()
