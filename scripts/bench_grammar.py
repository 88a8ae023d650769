"""JSON-schema generation with and without speculation, `specli serve` against native
llama-server with the same grammar (issue 18's benchmark).

Every request is a greedy /completion constrained by one JSON schema (a list of records,
whose repeated keys are what n-gram drafts find). specli serves every configuration from
one server (the request's `speculative` object picks none, ngram-mod or the draft model);
native llama-server gets one server per configuration (its --spec-type). The figure is
generated tokens over the request's wall time, median over prompts and rounds; rounds
alternate which server goes first. Prints a Markdown table for docs/performance.md.

    SPECLI_NATIVE_SERVER=1 bash scripts/build_native.sh    # builds llama-server once
    python scripts/bench_grammar.py [-m T -md D] [-n 256] [--rounds 2] [-t THREADS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from bench_serve import free_port, wait_healthy

from specli import defaults

SCHEMA = {"type": "array", "minItems": 4, "items": {
    "type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "city": {"type": "string"}, "email": {"type": "string"}},
    "required": ["name", "age", "city", "email"]}}
PROMPTS = [
    "List six employees of a small company as JSON, with name, age, city and email.",
    "Give eight customers of a bakery as JSON records: name, age, city, email.",
    "Write a JSON array of five fictional scientists with their name, age, city and email.",
]
CONFIGS = {  # name: (specli's request `speculative`, native --spec-type or None)
    "no speculation": (False, None),
    "ngram-mod": ({"type": "ngram-mod"}, "ngram-mod"),
    "draft model": ({"type": "draft-simple"}, "draft-simple"),
}


def tps(url: str, prompt: str, n: int, speculative=None) -> tuple[float, dict]:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "json_schema": SCHEMA,
            "cache_prompt": False}
    if speculative is not None:
        body["speculative"] = speculative
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/completion", json=body, timeout=900)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    doc = r.json()
    if doc.get("stop_type") == "eos":
        json.loads(doc["content"])  # the schema held (a truncated answer would not parse)
    return doc["tokens_predicted"] / wall, doc["timings"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model")
    ap.add_argument("-md", "--model-draft")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--draft", type=int, default=8)
    ap.add_argument("-t", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--native", default=str(Path(defaults.cache_dir()) / "native"))
    args = ap.parse_args()
    target, draft = (args.model, args.model_draft) if args.model else defaults.default_pair()
    import llama_cpp

    native = Path(args.native) / f"llama.cpp-{llama_cpp.__version__}" / "bin" / "llama-server"
    if not native.exists():
        sys.exit(f"no {native}: run SPECLI_NATIVE_SERVER=1 bash scripts/build_native.sh")
    common = ["-m", target, "-c", "2048", "-t", str(args.t), "--temp", "0"]
    results: dict[tuple[str, str], list[float]] = {}
    accept: dict[tuple[str, str], list[float]] = {}

    def measure(server: str, config: str, url: str, speculative=None) -> None:
        for p in PROMPTS:
            v, timings = tps(url, p, args.n, speculative)
            results.setdefault((server, config), []).append(v)
            if timings.get("draft_n"):
                accept.setdefault((server, config), []).append(
                    timings["draft_n_accepted"] / timings["draft_n"])
            print(f"{server:12s} {config:15s} {v:7.1f} t/s", file=sys.stderr)

    def start(argv: list[str]) -> tuple[subprocess.Popen, str]:
        port = free_port()
        proc = subprocess.Popen([*argv, "--port", str(port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            tps(url, PROMPTS[0], 16)  # warm up: weights paged in
        except BaseException:
            proc.terminate()  # never leave a server behind
            raise
        return proc, url

    for r in range(args.rounds):
        order = ["specli", "llama-server"][r % 2:] + ["specli", "llama-server"][:r % 2]
        for server in order:
            if server == "specli":
                proc, url = start([sys.executable, "-m", "specli", "serve", *common, "-md",
                                   draft, "--draft", str(args.draft)])
                try:
                    for config, (spec, _) in CONFIGS.items():
                        measure(server, config, url, spec)
                finally:
                    proc.terminate()
                    proc.wait(30)
                continue
            for config, (_, spec_type) in CONFIGS.items():
                extra = [] if spec_type is None else [
                    "--spec-type", spec_type, "--spec-draft-n-max", str(args.draft)] + (
                    ["-md", draft, "-td", str(args.t)] if spec_type == "draft-simple" else [])
                proc, url = start([str(native), *common, *extra, "--no-webui"])
                try:
                    measure(server, config, url)
                finally:
                    proc.terminate()
                    proc.wait(30)
    print("| configuration | specli serve (t/s) | llama-server (t/s) | specli / native | "
          "acceptance, specli / native |\n|---|---:|---:|---:|---:|")
    base = statistics.median(results[("specli", "no speculation")])
    for config in CONFIGS:
        s = statistics.median(results[("specli", config)])
        n = statistics.median(results[("llama-server", config)])
        a = [f"{statistics.mean(accept[(x, config)]):.0%}" if (x, config) in accept else "-"
             for x in ("specli", "llama-server")]
        print(f"| {config} | {s:.1f} ({s / base:.2f}x) | {n:.1f} | {s / n:.2f}x | "
              f"{a[0]} / {a[1]} |")


if __name__ == "__main__":
    main()
