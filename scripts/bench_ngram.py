"""Benchmark draftless (n-gram) speculation, hybrid drafting and `--draft auto`, in one run.

    bash scripts/build_native.sh             # once: native llama-lookup, speculative-simple
    python scripts/bench_ngram.py [--write docs/performance.md]

Greedy, the SmolLM2 F32 target, 2 threads, chat-formatted prompts: input-grounded ones (the
answer repeats its input) and open ones. For each prompt: the target alone; every n-gram type
at --draft 8 (specli's default); ngram-simple at fixed k and `--draft auto`; hybrid (n-gram +
the Q4_1 draft model) at --draft 8 and auto; and native llama.cpp with the same --spec-type
(llama-lookup for ngram-cache, llama-speculative-simple for the others) from the same vendored
build. Every configuration runs --repeat times, interleaved; medians are reported, as ratios
to the target alone measured in the same run.
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
from bench_run import fair_tps, machine  # noqa: E402

from specli import defaults  # noqa: E402
from specli.backend import Model  # noqa: E402
from specli.chat import render_chat  # noqa: E402
from specli.config import DRAFT_AUTO_MAX, DraftParams, ModelParams, NgramParams  # noqa: E402
from specli.config import SamplingParams  # noqa: E402
from specli.drafts import ModelDraft  # noqa: E402
from specli.engine import Engine, combine, ngram_drafts  # noqa: E402

FUNCTION = '''def merge_intervals(intervals):
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]'''

CODE = '''def load_scores(path):
    tmp = {}
    with open(path) as handle:
        for line in handle:
            name, score = line.strip().split(",")
            tmp[name] = tmp.get(name, 0) + int(score)
    best = max(tmp, key=tmp.get)
    print("best:", best, tmp[best])
    return tmp'''

ARTICLE = ("The city council voted on Tuesday to extend the bicycle lane network by twelve "
           "kilometres over the next two years. The plan connects the northern suburbs to the "
           "central station and adds protected crossings at six junctions. Supporters said the "
           "lanes would cut car traffic and make cycling safer for children. Opponents argued "
           "that the loss of parking spaces would hurt small shops along the main road. The "
           "council promised to review the effect on local businesses after the first year.")

PROMPTS = {  # name: (grounded?, user message)
    "docstring": (True, "Repeat the following Python function exactly, then add a docstring "
                        f"to it:\n\n{FUNCTION}"),
    "rename": (True, f"Rename the variable `tmp` to `totals` in this code and print the whole "
                     f"result:\n\n{CODE}"),
    "quote": (True, "Summarize this article. Quote its first two sentences word for word, then "
                    f"explain the disagreement:\n\n{ARTICLE}"),
    "open-code": (False, "Write a binary search in Python"),
    "open-prose": (False, "Explain how a hash map works."),
}
NGRAM_TYPES = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"]
FIXED_K = [4, 8, 16, 32]
BEGIN, END = "<!-- bench_ngram:begin -->", "<!-- bench_ngram:end -->"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    ap.add_argument("--write", help="replace the results block of this markdown file")
    args = ap.parse_args()

    draft_path = defaults.smollm2_q4_1()
    target_path = defaults.derived("f32", draft_path)
    bin_dir = native.native_bin_dir()
    if bin_dir is None:
        print("no native build (scripts/build_native.sh): native columns skipped", file=sys.stderr)
    tgt = Model(ModelParams(target_path, n_threads=args.threads))
    dm = Model(ModelParams(draft_path, n_threads=args.threads))
    greedy = SamplingParams(temp=0.0)
    tmp = Path(tempfile.mkdtemp())
    names = args.prompts.split(",")
    prompts = {}
    for name in names:
        rendered = render_chat(tgt.chat_template(), PROMPTS[name][1])
        (tmp / f"{name}.txt").write_text(rendered + "\n")  # native -f drops one newline
        prompts[name] = tgt.tokenize(rendered)

    def engine(types: list[str], k: int | str, model: bool = False) -> Engine:
        auto = k == "auto"
        sources = ngram_drafts(types, NgramParams(), target_path)
        if model:
            sources.append(ModelDraft(dm, n_vocab_target=tgt.n_vocab))
        dp = DraftParams(n_max=DRAFT_AUTO_MAX if auto else int(k), adaptive=auto)
        return Engine(tgt, combine(sources, auto), dp)

    configs: dict[str, tuple[list[str], int | str, bool]] = {
        **{f"{t} k=8": ([t], 8, False) for t in NGRAM_TYPES},
        **{f"ngram-simple k={k}": (["ngram-simple"], k, False) for k in FIXED_K if k != 8},
        "ngram-simple auto": (["ngram-simple"], "auto", False),
        **{f"hybrid k={k}": (["ngram-simple"], k, True) for k in FIXED_K},
        "hybrid auto": (["ngram-simple"], "auto", True),
    }
    tps: dict[tuple[str, str], list[float]] = {}
    acc: dict[tuple[str, str], tuple[int, int]] = {}
    for rep in range(args.repeat):
        for name, ids in prompts.items():
            print(f"[{rep + 1}/{args.repeat}] {name}", file=sys.stderr)
            plain = Engine(tgt).complete(ids, args.n, greedy, speculative=False)
            tps.setdefault((name, "target alone"), []).append(plain.stats.decode_tps)
            for label, (types, k, model) in configs.items():
                out = engine(types, k, model).complete(ids, args.n, greedy)
                assert out.tokens == plain.tokens, f"greedy output drifted: {label}, {name}"
                tps.setdefault((name, label), []).append(out.stats.decode_tps)
                acc[(name, label)] = (out.stats.n_drafted, out.stats.n_accept)
            if bin_dir is None:
                continue
            for t in NGRAM_TYPES:
                r = native.ngram(bin_dir, target_path, t, str(tmp / f"{name}.txt"), args.n, 8,
                                 args.threads)
                label = f"native {t}"
                tps.setdefault((name, label), []).append(fair_tps(r, plain.stats))
                acc[(name, label)] = (r.n_drafted, r.n_accept)

    labels = ["target alone", *configs] + ([f"native {t}" for t in NGRAM_TYPES] if bin_dir
                                           else [])
    speedup = {(p, c): statistics.median(tps[(p, c)]) / statistics.median(tps[(p, "target alone")])
               for p in prompts for c in labels}
    lines = [
        f"Machine: {machine()}; threads {args.threads}. Target `{Path(target_path).name}`, "
        f"hybrid draft `{Path(draft_path).name}`, greedy, -n {args.n}, chat-formatted prompts, "
        f"median of {args.repeat} interleaved rounds. Cells: speedup over the target alone in "
        "the same round (accepted/drafted tokens). Native speeds count the tokens output.",
        "",
        "| configuration | " + " | ".join(prompts) + " | geomean grounded | geomean open |",
        "|---|" + "---:|" * (len(prompts) + 2),
    ]
    grounded = [p for p in prompts if PROMPTS[p][0]]
    open_ = [p for p in prompts if not PROMPTS[p][0]]

    def geomean(values: list[float]) -> str:
        return f"{statistics.geometric_mean(values):.2f}x" if values else "-"

    for c in labels:
        cells = []
        for p in prompts:
            d, a = acc.get((p, c), (0, 0))
            cells.append(f"{speedup[(p, c)]:.2f}x" + (f" ({a}/{d})" if d else ""))
        lines.append(f"| {c} | " + " | ".join(cells) + " | "
                     + geomean([speedup[(p, c)] for p in grounded]) + " | "
                     + geomean([speedup[(p, c)] for p in open_]) + " |")
    lines += ["", "Target alone, decode t/s (median): " + ", ".join(
        f"{p} {statistics.median(tps[(p, 'target alone')]):.1f}" for p in prompts)]
    table = "\n".join(lines)
    print(table)
    if args.write:
        path = Path(args.write)
        doc = path.read_text()
        if BEGIN not in doc:
            doc += f"\n{BEGIN}\n{END}\n"
        head, rest = doc.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        path.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")


if __name__ == "__main__":
    main()
