"""Benchmark draftless (n-gram) speculation, hybrid drafting and `--draft auto`, in one run.

    bash scripts/build_native.sh             # once: native llama-lookup, speculative-simple
    python scripts/bench_ngram.py [--write docs/performance.md]

Greedy, the SmolLM2 F32 target, 2 threads, chat-formatted prompts: input-grounded ones (the
answer repeats its input) and open ones. For each prompt: the target alone; every n-gram type
with llama.cpp's defaults; ngram-simple at other fixed m and with `--draft auto`; hybrid
(ngram-simple + the Q4_1 draft model) at fixed k and auto; and native llama.cpp with the same
--spec-type (llama-lookup for ngram-cache, llama-speculative-simple for the others) from the
same vendored build. Every configuration runs --repeat times, interleaved; medians are
reported, as ratios to the target alone measured in the same run.
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

from specli import config, defaults  # noqa: E402
from specli.backend import Model  # noqa: E402
from specli.drafts import ModelDraft  # noqa: E402
from specli.engine import Engine  # noqa: E402
from specli.plan import combine, ngram_drafts  # noqa: E402
from specli.template_host import render_chat  # noqa: E402

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

TYPOS = ("Teh city council voted on Tuesday to extend the bicycle lane netwrok by twelve "
         "kilometres over the next two years. The plan conects the northern suburbs to the "
         "central station and adds protected crossings at six junctions. Supporters said the "
         "lanes would cut car trafic and make cycling safer for children.")

RECORD = ('{\n  "name": "Alice",\n  "age": 30,\n  "email": "alice@example.com",\n  "address": {\n'
          '    "street": "12 High Street",\n    "city": "Leeds",\n    "postcode": "LS1 4AB"\n'
          '  },\n  "tags": ["admin", "editor", "reviewer"]\n}')

# grounded prompts were picked because SmolLM2-135M answers them by repeating its input; it
# paraphrases "repeat this function with a docstring" instead, so that one is not here
PROMPTS = {  # name: (grounded?, user message)
    "rename": (True, f"Rename the variable `tmp` to `totals` in this code and print the whole "
                     f"result:\n\n{CODE}"),
    "comment": (True, f"Add a comment to every line of this code:\n\n{CODE}"),
    "json": (True, f"Print this JSON again with the age changed to 31:\n\n{RECORD}"),
    "quote": (True, "Quote the article below in full, then give a one-sentence summary:\n\n"
                    f"{ARTICLE}"),
    "typos": (True, "Correct the spelling mistakes in the following paragraph and print the "
                    f"corrected paragraph in full:\n\n{TYPOS}"),
    "open-code": (False, "Write a binary search in Python"),
    "open-prose": (False, "Explain how a hash map works."),
}
NGRAM_TYPES = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"]
FIXED_K = [4, 8, 16, 32]  # the draft model's k, in hybrid
FIXED_M = [16, 24, 32]  # ngram-simple's m (48, llama.cpp's default, is its own row; m < n
# never drafts)
BEGIN, END = "<!-- bench_ngram:begin -->", "<!-- bench_ngram:end -->"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    ap.add_argument("--only", help="comma-separated configuration labels (default: all)")
    ap.add_argument("--no-native", action="store_true", help="skip the native programs")
    ap.add_argument("--write", help="replace the results block of this markdown file")
    args = ap.parse_args()

    draft_path = defaults.smollm2_q4_1()
    target_path = defaults.derived("f32", draft_path)
    bin_dir = None if args.no_native else native.native_bin_dir()
    if bin_dir is None and not args.no_native:
        print("no native build (scripts/build_native.sh): native columns skipped", file=sys.stderr)
    tgt = Model(config.ModelParams(target_path, n_threads=args.threads))
    dm = Model(config.ModelParams(draft_path, n_threads=args.threads))
    greedy = config.SamplingParams(temp=0.0)
    tmp = Path(tempfile.mkdtemp())
    names = args.prompts.split(",")
    prompts = {}
    for name in names:
        rendered = render_chat(tgt.chat_template(), PROMPTS[name][1])
        (tmp / f"{name}.txt").write_text(rendered + "\n")  # native -f drops one newline
        prompts[name] = tgt.tokenize(rendered)

    def engine(types: list[str], k: int | str, model: bool = False, m: int = 48) -> Engine:
        auto = k == "auto"
        dp = config.DraftParams(n_max=config.DRAFT_AUTO_MAX if auto else int(k), adaptive=auto)
        sources = ngram_drafts(types, config.NgramParams(size_m=m), tgt.n_vocab)
        if model:
            sources.append(ModelDraft(dm, n_vocab_target=tgt.n_vocab))
        return Engine(tgt, combine(sources, auto), dp)

    # (types, --draft, draft model?, ngram-simple's m); the n-gram types run with llama.cpp's
    # defaults, each drafting up to its own m; --draft 8 caps ngram-cache and the draft model
    configs: dict[str, tuple[list[str], int | str, bool, int]] = {
        **{t: ([t], 8, False, 48) for t in NGRAM_TYPES},
        **{f"ngram-simple m={m}": (["ngram-simple"], 8, False, m) for m in FIXED_M},
        "ngram-simple auto": (["ngram-simple"], "auto", False, 48),
        **{f"hybrid k={k}": (["ngram-simple"], k, True, 48) for k in FIXED_K},
        "hybrid auto": (["ngram-simple"], "auto", True, 48),
    }
    if args.only:
        configs = {c: v for c, v in configs.items() if c in args.only.split(",")}
    tps: dict[tuple[str, str], list[float]] = {}
    acc: dict[tuple[str, str], tuple[int, int]] = {}
    drift: set[str] = set()
    same: dict[tuple[str, str], list[float]] = {}  # specli / native speed, same tokens
    for rep in range(args.repeat):
        for name, ids in prompts.items():
            print(f"[{rep + 1}/{args.repeat}] {name}", file=sys.stderr)
            plain = Engine(tgt).complete(ids, args.n, greedy, speculative=False)
            tps.setdefault((name, "target alone"), []).append(plain.stats.decode_tps)
            for label, (types, k, model, m) in configs.items():
                out = engine(types, k, model, m).complete(ids, args.n, greedy)
                if out.tokens != plain.tokens:  # a near-tie flipped by batched decoding
                    i = next((i for i, (a, b) in enumerate(zip(out.tokens, plain.tokens,
                                                               strict=False)) if a != b),
                             min(len(out.tokens), len(plain.tokens)))
                    drift.add(f"{label} on {name} (from token {i})")
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
                # native overshoots -n by up to a whole draft, and a repetitive tail drafts
                # well: compare with specli over as many tokens as native output
                n_same = r.n_predict if plain.stats.finish_reason == "length" else args.n
                out = engine([t], 8).complete(ids, n_same, greedy)
                # both sides count the end-of-generation token, which native counts and
                # specli decodes but does not count in decode_tps
                s = out.stats
                ours = (s.n_predict + (s.finish_reason == "stop")) / s.t_decode_s
                same.setdefault((name, t), []).append(ours / fair_tps(r, s))

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
    lines.append("")
    for family, fixed in (("ngram-simple", ["ngram-simple", *(f"ngram-simple m={m}"
                                                               for m in FIXED_M)]),
                          ("hybrid", [f"hybrid k={k}" for k in FIXED_K])):
        fixed = [c for c in fixed if c in configs]
        if f"{family} auto" not in configs or not fixed:
            continue
        for group, members in (("grounded", grounded), ("open", open_)):
            if not members:
                continue
            score = {c: statistics.geometric_mean([speedup[(p, c)] for p in members])
                     for c in [*fixed, f"{family} auto"]}
            best = max(fixed, key=score.get)
            lines.append(f"- {family}, {group} prompts: auto {score[f'{family} auto']:.2f}x, "
                         f"best fixed ({best}) {score[best]:.2f}x: auto / best = "
                         f"{score[f'{family} auto'] / score[best]:.2f}")
    if same:
        lines += ["", "specli / native decode speed over the same number of tokens (specli "
                  "rerun with -n = what native output; an end-of-generation token counts on "
                  "both sides), median per prompt, then geomean:", "",
                  "| --spec-type | " + " | ".join(prompts) + " | grounded | open |",
                  "|---|" + "---:|" * (len(prompts) + 2)]
        for t in NGRAM_TYPES:
            ratio = {p: statistics.median(same[(p, t)]) for p in prompts}
            lines.append(f"| {t} | " + " | ".join(f"{ratio[p]:.2f}x" for p in prompts) + " | "
                         + geomean([ratio[p] for p in grounded]) + " | "
                         + geomean([ratio[p] for p in open_]) + " |")
    lines += ["", "Target alone, decode t/s (median): " + ", ".join(
        f"{p} {statistics.median(tps[(p, 'target alone')]):.1f}" for p in prompts)]
    if drift:
        lines += ["", "Output differed from plain decoding (a near-tie between the top two "
                  "logits, flipped by batched decoding; see docs/performance.md): "
                  + "; ".join(sorted(drift)) + "."]
    publish(lines, args.write, BEGIN, END)


if __name__ == "__main__":
    main()
