"""A coding agent's turn on `specli serve` and native llama-server (issue 35's benchmark).

The session: a source file in the context, and a tool call that writes it back
(`write_file`, tool_choice required: the call's grammar on, the arguments a copy of the
context, where n-gram drafts are accepted). Each server runs alone, one mode at a time,
modes alternating by round: no speculation, ngram-mod, the draft model, both. The template is
Hermes 2 Pro's (tests/data/templates/), a `<tool_call>` family both servers parse and
constrain. Prints a Markdown table of generated tokens per second (completion tokens over the
request's wall time) for docs/performance.md.

    SPECLI_NATIVE_SERVER=1 bash scripts/build_native.sh
    python scripts/bench_agent.py -m F16.gguf -md Q4_1.gguf [--rounds 3] [-t 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from bench_serve import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "tests" / "data" / "templates" / \
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"
SOURCE = (ROOT / "specli" / "cost.py").read_text()
WRITE = {"type": "function", "function": {
    "name": "write_file", "description": "Write a file's whole new content",
    "parameters": {"type": "object", "properties": {"content": {"type": "string"}},
                   "required": ["content"]}}}
SESSION = {
    "messages": [{"role": "user", "content": "Copy this file exactly into write_file's "
                  f"content:\n{SOURCE}"}],
    "tools": [WRITE], "tool_choice": "required", "parallel_tool_calls": False,
    "temperature": 0}
MODES = {"none": ([], []), "ngram-mod": (["--spec-type", "ngram-mod"],) * 2}


def modes(draft: str) -> dict[str, tuple[list[str], list[str]]]:
    """mode -> (specli's flags, llama-server's flags)."""
    out = dict(MODES)
    out["draft"] = (["-md", draft, "--spec-type", "draft-simple"],) * 2
    out["draft+ngram-mod"] = (["-md", draft, "--spec-type", "draft-simple,ngram-mod"],) * 2
    return out


def turn(url: str, n: int) -> tuple[float, float, str]:
    """(tokens/s, acceptance, the call's arguments) of one agent turn."""
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json={**SESSION, "max_tokens": n},
                   timeout=900)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    doc = r.json()
    calls = doc["choices"][0]["message"].get("tool_calls") or [{}]
    t = doc.get("timings", {})
    acc = t.get("draft_n_accepted", 0) / t["draft_n"] if t.get("draft_n") else 0.0
    return doc["usage"]["completion_tokens"] / wall, acc, \
        calls[0].get("function", {}).get("arguments", "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-md", "--model-draft", required=True)
    ap.add_argument("-n", type=int, default=400)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--native-bin", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    import native

    bin_dir = Path(args.native_bin) if args.native_bin else native.native_bin_dir()
    server = bin_dir / "llama-server" if bin_dir else None
    if server is None or not server.exists():
        sys.exit("no native llama-server: SPECLI_NATIVE_SERVER=1 scripts/build_native.sh")
    common = ["-m", args.model, "-c", "4096", "-t", str(args.t), "--temp", "0", "--jinja",
              "--chat-template-file", str(TEMPLATE)]
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    texts: dict[tuple[str, str], str] = {}
    for r in range(args.rounds):
        for mode, (ours, theirs) in modes(args.model_draft).items():
            runs = [("specli", [sys.executable, "-m", "specli", "serve", *common, *ours]),
                    ("llama-server", [str(server), *common, *theirs, "-td", str(args.t),
                                      "--no-webui"])]
            for name, cmd in runs[r % 2:] + runs[:r % 2]:
                port = free_port()
                proc = subprocess.Popen([*cmd, "--port", str(port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                url = f"http://127.0.0.1:{port}"
                try:
                    wait_healthy(url, proc)
                    tps, acc, text = turn(url, args.n)
                finally:
                    proc.terminate()
                    proc.wait(30)
                results.setdefault((name, mode), []).append((tps, acc))
                texts[(name, mode)] = text
                print(f"round {r + 1}: {name:12s} {mode:16s} {tps:6.1f} t/s, accepted "
                      f"{100 * acc:5.1f}%", file=sys.stderr)
    base = {name: statistics.median(t for t, _ in results[(name, "none")])
            for name in ("specli", "llama-server")}
    print("| mode | specli (t/s) | speedup | accepted | llama-server (t/s) | speedup | "
          "accepted | specli / llama-server |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode in modes(args.model_draft):
        row = []
        for name in ("specli", "llama-server"):
            tps = statistics.median(t for t, _ in results[(name, mode)])
            acc = statistics.median(a for _, a in results[(name, mode)])
            row.append((tps, tps / base[name], acc))
        (s, ss, sa), (n, ns, na) = row
        print(f"| {mode} | {s:.1f} | {ss:.2f}x | {100 * sa:.0f}% | {n:.1f} | {ns:.2f}x | "
              f"{100 * na:.0f}% | {s / n:.2f}x |")
    same = texts[("specli", "none")] == texts[("specli", "draft+ngram-mod")]
    print(f"\nspecli's call with and without speculation identical: {same}", file=sys.stderr)


if __name__ == "__main__":
    main()
