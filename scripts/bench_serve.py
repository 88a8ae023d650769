"""Aggregate throughput of `specli serve` against native llama-server (issues 5 and 56).

The servers serve the same target with the same flags (-np, -c, -t, greedy): specli serve
with the draft (--draft K, or auto: its per-step policy), llama-server with the same draft
(--spec-type draft-simple, --spec-draft-n-max K; 8 for auto), and llama-server without a
draft (plain batched decoding: what speculation has to beat under load). 1, 2, 4 ... clients
stream chat completions at once, each several requests in turn; the figure is generated
tokens (from each stream's usage chunk) over the wall time of the round. Rounds rotate the
servers' order. Prints a Markdown table for docs/performance.md.

    SPECLI_NATIVE_SERVER=1 bash scripts/build_native.sh    # builds llama-server once
    python scripts/bench_serve.py [-m T -md D] [--clients 1,2,4,8] [-n 128] [--rounds 3]
                                   [--per-client 2] [--draft auto]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from specli import defaults

PROMPTS = [
    "Write a binary search in Python.",
    "Explain how a hash map works.",
    "Write a JavaScript function that debounces another function.",
    "What is the difference between TCP and UDP?",
    "Write a SQL query that finds the top 3 customers by total order value.",
    "List five tips for better sleep.",
    "Write a haiku about autumn.",
    "Summarize the causes of World War I in three sentences.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("server did not become healthy")


def stream(url: str, prompt: str, n: int, out: list[int]) -> None:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                doc = json.loads(line[6:])
                if doc.get("usage"):
                    out.append(doc["usage"]["completion_tokens"])


def drafted(url: str) -> int:
    """Draft tokens one request used (llama-server's timings.draft_n): both must speculate."""
    r = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 32,
        "temperature": 0}, timeout=600)
    return r.json().get("timings", {}).get("draft_n", 0)


def client(url: str, prompts: list[str], n: int, out: list[int]) -> None:
    for p in prompts:
        stream(url, p, n, out)


def round_tps(url: str, clients: int, n: int, offset: int, per_client: int = 1) -> float:
    """Tokens/s of `clients` clients streaming at once, each `per_client` requests in turn
    (several: one prompt's output length and acceptance swing a round by ±20%)."""
    counts: list[int] = []
    threads = [threading.Thread(target=client, args=(
        url, [PROMPTS[(offset + i * per_client + j) % len(PROMPTS)] for j in range(per_client)],
        n, counts)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if len(counts) != clients * per_client:
        raise RuntimeError("a stream did not report its usage")
    return sum(counts) / wall


def first_token(url: str, prompt: str, n: int) -> float:
    """Seconds from sending a streamed chat request to its first content."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
            "temperature": 0, "stream": True}
    t0, ttft = time.perf_counter(), None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():  # read to the end: the slot is freed as in use
            if ttft is None and line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("no content in a stream")
    return ttft


def long_prompt(tag: int, words: int = 1150) -> str:
    """About 2,000 tokens, unique from its first token (no cached prefix)."""
    body = " ".join(f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(words // 8))
    return f"Request {tag}. Summarize the following list in one sentence. {body}"


def ttft_round(url: str, running: int, n: int, tag: int, longs: int = 4) -> list[float]:
    """Time to first token of short requests sent one after another while `longs` long
    prompts arrive in turn, with `running` clients streaming n-token chats throughout."""
    stop = threading.Event()

    def run(i: int) -> None:
        while not stop.is_set():
            stream(url, PROMPTS[i % len(PROMPTS)], n, [])

    background = [threading.Thread(target=run, args=(i,)) for i in range(running)]
    for t in background:
        t.start()
    time.sleep(2.0)  # the running clients are generating
    long_done = threading.Event()

    def longs_in_turn() -> None:
        for j in range(longs):
            first_token(url, long_prompt(1000 * tag + j), 8)
        long_done.set()

    lt = threading.Thread(target=longs_in_turn)
    lt.start()
    ttfts = []
    while not long_done.is_set():
        ttfts.append(first_token(url, PROMPTS[len(ttfts) % len(PROMPTS)], 4))
    lt.join()
    stop.set()
    for t in background:
        t.join()
    return ttfts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model")
    ap.add_argument("-md", "--model-draft")
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--draft", default="8", help="specli's --draft: K or auto")
    ap.add_argument("-c", type=int, default=4096)
    ap.add_argument("-t", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--per-client", type=int, default=4,
                    help="requests each client makes in turn per round")
    ap.add_argument("--native", default=str(Path(defaults.cache_dir()) / "native"))
    ap.add_argument("--no-draft", action="store_true",
                    help="both servers without a draft: plain batched decoding")
    ap.add_argument("--no-plain", action="store_true",
                    help="leave out llama-server without a draft")
    ap.add_argument("--specli-plain", action="store_true",
                    help="also specli serve without a draft (the plan's own fallback)")
    ap.add_argument("--ttft", action="store_true",
                    help="instead: time to first token of short requests while 2,000-token "
                    "prompts arrive, with 4 clients streaming (-c large enough per slot)")
    args = ap.parse_args()
    target, draft = (args.model, args.model_draft) if args.model else defaults.default_pair()
    clients = [int(c) for c in args.clients.split(",")]
    n_parallel = max(clients)
    import llama_cpp

    native = Path(args.native) / f"llama.cpp-{llama_cpp.__version__}" / "bin" / "llama-server"
    if not native.exists():
        sys.exit(f"no {native}: run SPECLI_NATIVE_SERVER=1 bash scripts/build_native.sh")
    common = ["-m", target, "-np", str(n_parallel), "-c", str(args.c), "-t", str(args.t),
              "--temp", "0"]
    with_draft = [] if args.no_draft else ["-md", draft]
    spec = [] if args.no_draft else [*with_draft, "--draft", args.draft]
    native_k = "8" if args.draft == "auto" else args.draft
    servers = {}
    port = free_port()
    servers["specli"] = (subprocess.Popen(
        [sys.executable, "-m", "specli", "serve", *common, *spec, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), f"http://127.0.0.1:{port}")
    if args.specli_plain and not args.no_draft:
        port = free_port()
        servers["specli plain"] = (subprocess.Popen(
            [sys.executable, "-m", "specli", "serve", *common, "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), f"http://127.0.0.1:{port}")
    port = free_port()
    # without --spec-type draft-simple, this llama-server loads -md and never drafts
    native_spec = [] if args.no_draft else [*with_draft, "--spec-type", "draft-simple",
                                            "--spec-draft-n-max", native_k, "-td",
                                            str(args.t)]
    servers["llama-server"] = (subprocess.Popen(
        [str(native), *common, *native_spec, "--port", str(port), "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), f"http://127.0.0.1:{port}")
    if not args.no_draft and not args.no_plain:
        port = free_port()
        servers["llama-server plain"] = (subprocess.Popen(
            [str(native), *common, "--port", str(port), "--no-webui"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), f"http://127.0.0.1:{port}")
    try:
        for name, (proc, url) in servers.items():
            wait_healthy(url, proc)
            round_tps(url, 1, 8, 0)  # warm up: weights paged in
            if not args.no_draft and "plain" not in name and not drafted(url):
                sys.exit(f"{name} does not speculate: no draft tokens in its timings")
        if args.ttft:
            ttfts: dict[str, list[float]] = {}
            for r in range(args.rounds):
                order = list(servers.items())
                for name, (_, url) in order[r % len(order):] + order[:r % len(order)]:
                    got = ttft_round(url, 4, args.n, r)
                    ttfts.setdefault(name, []).extend(got)
                    print(f"round {r + 1}: {name:18s} {len(got)} short requests, ms: "
                          + " ".join(f"{1e3 * x:.0f}" for x in sorted(got)), file=sys.stderr,
                          flush=True)
            print("| server | short requests | TTFT p50 (ms) | TTFT p99 (ms) |\n"
                  "|---|---:|---:|---:|")
            for name, got in ttfts.items():
                q = statistics.quantiles(got, n=100, method="inclusive")
                print(f"| {name} | {len(got)} | {1e3 * statistics.median(got):.0f} | "
                      f"{1e3 * q[98]:.0f} |")
            return
        results: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            order = list(servers.items())
            order = order[r % len(order):] + order[:r % len(order)]  # who goes first rotates
            for c in clients:
                for name, (_, url) in order:
                    tps = round_tps(url, c, args.n, r, args.per_client)
                    results.setdefault((name, c), []).append(tps)
                    print(f"round {r + 1}: {name:18s} {c} clients: {tps:7.1f} t/s",
                          file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    plain = "llama-server plain" in servers
    print("| clients | specli serve (t/s) | llama-server (t/s) | ratio |"
          + (" llama-server, no draft (t/s) | ratio to the better |" if plain else "")
          + "\n|---:|---:|---:|---:|" + ("---:|---:|" if plain else ""))
    for c in clients:
        s = statistics.median(results[("specli", c)])
        n = statistics.median(results[("llama-server", c)])
        row = f"| {c} | {s:.1f} | {n:.1f} | {s / n:.2f}x |"
        if plain:
            p = statistics.median(results[("llama-server plain", c)])
            row += f" {p:.1f} | {s / max(n, p):.2f}x |"
        if "specli plain" in servers:
            row += f" specli, no draft: {statistics.median(results[('specli plain', c)]):.1f}"
        print(row)


if __name__ == "__main__":
    main()
