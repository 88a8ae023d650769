"""Benchmark a target split over llama.cpp RPC workers (`specli rpc-server` on loopback ports)
against the same target local, plain and speculative, with the bytes that cross the network.

    python scripts/bench_rpc.py [--write docs/performance.md]

Configurations: everything local; the target's layers all on one worker, half on one worker
(the rest local), all over two workers, and a third each over local + two workers. The draft
stays local (-devd none) in every one. Bytes are what this process's connections to the
workers carried (TCP_INFO), divided by the tokens generated and by the target's forward
passes (one per token plain; one per verification when speculating). Greedy; each
configuration runs --repeat rounds over the prompts (plain and speculative alternating on
each prompt), one configuration after another; medians of decode t/s.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_run import machine, publish  # noqa: E402
from bench_tree import PROMPTS  # noqa: E402 - the same three prompts

from specli import defaults, rpc  # noqa: E402
from specli.backend import Model  # noqa: E402
from specli.config import DraftPolicy, ModelParams, SamplingParams  # noqa: E402
from specli.drafts import ModelDraft  # noqa: E402
from specli.engine import Engine  # noqa: E402
from specli.stats import Stats  # noqa: E402
from specli.template_host import render_chat  # noqa: E402

BEGIN, END = "<!-- bench_rpc:begin -->", "<!-- bench_rpc:end -->"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "specli", "rpc-server", "-p", str(port),
                          "-t", str(threads)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        if "listening on" in line:
            return p, f"127.0.0.1:{port}"
    raise SystemExit("a worker did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="target (default: the embedded SmolLM2 as F32)")
    ap.add_argument("-md", "--model-draft", help="draft (default: the embedded Q4_1)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads here and on each "
                    "worker")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--write", help="replace the results block of this markdown file")
    args = ap.parse_args()
    q4 = defaults.smollm2_q4_1()
    target_path = args.model or defaults.derived("f32", q4)
    draft_path = args.model_draft or q4
    procs, eps = zip(*(start_worker(args.threads) for _ in range(2)), strict=True)
    try:
        rows = run(args, target_path, draft_path, list(eps))
    finally:
        for p in procs:
            p.kill()
    n_layer = rows.pop("n_layer")
    lines = [
        f"Machine: {machine()}; {Path(target_path).name} target, {Path(draft_path).name} "
        f"draft (always local), {n_layer} layers; workers: `specli rpc-server -t "
        f"{args.threads}` on loopback ports of the same machine, client -t {args.threads}; "
        f"greedy, k = {args.k}, -n {args.n}, prompts: {', '.join(PROMPTS)} (chat template), "
        f"median of {args.repeat} rounds (plain and speculative alternate). Bytes: both "
        "directions over the client's connections to the workers while decoding (after the "
        "prompt), per target forward pass and per generated token.",
        "",
        "| where the target's layers are | decoding | t/s | vs local plain | vs local, same "
        "decoding | tokens per target pass | B/pass | B/token |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {d: statistics.median(rows[("local", d)]["tps"]) for d in ("plain", "speculative")}
    for (where, dec), r in rows.items():
        tps = statistics.median(r["tps"])
        per = r["tokens"] / max(r["passes"], 1)
        lines.append(
            f"| {where} | {dec} | {tps:.1f} | {tps / base['plain']:.2f}x | "
            f"{tps / base[dec]:.2f}x | {per:.2f} | " +
            (f"{r['bytes'] / max(r['passes'], 1):,.0f} | {r['bytes'] / max(r['tokens'], 1):,.0f} |"
             if r["bytes"] else "- | - |"))
    publish(lines, args.write, BEGIN, END)


def run(args, target_path: str, draft_path: str, eps: list[str]) -> dict:
    probe = Model(ModelParams(target_path, n_ctx=64, n_threads=1))
    layers = probe.n_layer
    probe.close()
    # label: (workers, -ngl, -ts); llama.cpp's -ngl N offloads the output layer and the last
    # N - 1 blocks, so the logits come back over the network whenever a worker holds layers
    half, third = layers // 2 + 1, layers // 3 * 2 + 1
    configs = {
        "local": ((), 0, ()),
        "1 worker, every layer (-ngl 99)": (eps[:1], 99, ()),
        f"1 worker + local, half each (-ngl {half})": (eps[:1], half, ()),
        "2 workers, half each (-ngl 99 -ts 1,1)": (eps, 99, (1.0, 1.0)),
        f"2 workers + local, a third each (-ngl {third} -ts 1,1)": (eps, third, (1.0, 1.0)),
    }
    draft = ModelDraft(Model(ModelParams(draft_path, n_threads=args.threads, devices=(),
                                         n_ctx=1024)))
    greedy = SamplingParams(temp=0.0, seed=0)
    rows: dict = {"n_layer": layers}
    reference: dict[str, list[int]] = {}
    for label, (workers, ngl, ts) in configs.items():
        tgt = Model(ModelParams(target_path, n_threads=args.threads, n_ctx=1024, rpc=workers,
                                n_gpu_layers=ngl, tensor_split=ts,
                                devices=None if workers else ()))
        prompts = {name: tgt.tokenize(render_chat(tgt.chat_template(), text))
                   for name, text in PROMPTS.items()}
        for dec in ("plain", "speculative"):
            rows[(label, dec)] = {"tps": [], "bytes": 0, "tokens": 0, "passes": 0}
        for rep in range(args.repeat):
            for name, ids in prompts.items():
                print(f"{label} [{rep + 1}/{args.repeat}] {name}", file=sys.stderr)
                for dec in ("plain", "speculative"):
                    row = rows[(label, dec)]
                    engine = (Engine(tgt) if dec == "plain" else
                              Engine(tgt, draft, DraftPolicy(n_max=args.k)))
                    stats, tokens, first, mark = Stats(), [], None, None
                    for token, _ in engine.steps(ids, args.n, greedy, stats,
                                                 speculative=dec != "plain"):
                        tokens.append(token)
                        if first is None:  # the pass that took the prompt is over
                            first = (*rpc.traffic(workers), tgt.n_decode_calls)
                        elif mark is None and tgt.n_decode_calls != first[2]:
                            mark = (*first, len(tokens) - 1)  # this token's pass: the next
                    if mark is None:
                        continue
                    s1, r1 = rpc.traffic(workers)
                    row["tps"].append(stats.decode_tps)
                    row["bytes"] += (s1 - mark[0]) + (r1 - mark[1])
                    row["passes"] += tgt.n_decode_calls - mark[2]
                    row["tokens"] += len(tokens) - mark[3]
                    ref = reference.setdefault(name, tokens)
                    if tokens != ref:
                        print(f"  note: {label} {dec} differs from the first output",
                              file=sys.stderr)
        tgt.close()
    draft.model.close()
    return rows


if __name__ == "__main__":
    main()
