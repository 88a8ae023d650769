"""Benchmark `specli run`'s engine against the target alone and native llama.cpp, in one run.

    python scripts/build_native.sh            # once: native binaries from the same llama.cpp
    python scripts/bench_run.py [--write docs/performance.md] [-ngl 99 -ngld 99]
    python scripts/bench_run.py --heads [--write docs/performance.md]   # the draft heads

Greedy, same pair, same prompts, same k, same threads. Every configuration runs --repeat
times, interleaved, and the median decode speed is reported: speeds are ratios measured on one
machine in one run, never absolute promises. specli runs in this process (the engine `run`
uses); native programs run as subprocesses and report their own decode speed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import native  # noqa: E402

from specli import defaults  # noqa: E402
from specli.backend import Model  # noqa: E402
from specli.config import DraftParams, ModelParams, SamplingParams  # noqa: E402
from specli.drafts import ModelDraft  # noqa: E402
from specli.engine import Engine  # noqa: E402
from specli.template_host import render_chat  # noqa: E402

PROMPTS = {
    "code": "Write a binary search in Python",
    "prose": "Explain how a hash map works.",
    "structured": "Write a SQL query that finds the top 3 customers by total order value.",
}
# --prompts wide: more prompts, so one near-tied greedy choice moves the acceptance less
WIDE = {
    **PROMPTS,
    "story": "Write a short story about a lighthouse keeper.",
    "list": "List ten fruits and their colours.",
    "math": "Explain step by step how to compute 17 times 23.",
    "email": "Write a polite email asking for a meeting next week.",
    "rust": "Write a Rust function that reverses a string.",
    "history": "Summarise the causes of the French Revolution.",
    "json": "Give a JSON object describing a book with title, author and year.",
    "shell": "Write a bash script that counts lines in every .py file.",
    "recipe": "Give a recipe for pancakes.",
}
BEGIN, END = "<!-- bench_run:begin -->", "<!-- bench_run:end -->"
HEADS_BEGIN, HEADS_END = "<!-- bench_heads:begin -->", "<!-- bench_heads:end -->"
# the draft heads: --spec-type, the target and the head file among head_models.write_all's
# (label: --spec-type, target, head)
HEADS = {"draft-mtp": ("draft-mtp", "mtp", None),
         "draft-mtp (Gemma 4 assistant)": ("draft-mtp", "gemma4", "assistant"),
         "draft-eagle3": ("draft-eagle3", "llama", "eagle3"),
         "draft-dflash": ("draft-dflash", "llama", "dflash"),
         "draft-dspark": ("draft-dspark", "llama", "dspark")}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = ""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"{cpu}, {os.cpu_count()} cores" + (f", GPU: {gpu}" if gpu else "")


def publish(lines: list[str], path: str | None, begin: str, end: str) -> None:
    """A benchmark's markdown on stdout, and between its markers in `path` if given."""
    table = "\n".join(lines)
    print(table)
    if path:
        write_block(path, begin, end, table)


def write_block(path: str, begin: str, end: str, table: str) -> None:
    """Replace the text between the begin and end markers of a markdown file (appended at
    its end the first time)."""
    p = Path(path)
    doc = p.read_text() if p.exists() else ""
    if begin not in doc:
        doc += f"\n{begin}\n{end}\n"
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    p.write_text(f"{head}{begin}\n{table}\n{end}{tail}")


def fair_tps(r: native.NativeRun, ours) -> float:
    """Native decode speed over the tokens it actually output.

    Native programs add every accepted token of a step to their count, including the
    end-of-generation token and whatever was accepted after it, which is never printed. When
    the text ended that way (specli, same greedy output, stopped on end-of-generation), count
    the text plus the end-of-generation token. Tokens past -n are real output and all count.
    """
    if not r.decode_tps:
        return 0.0
    seconds = r.n_predict / r.decode_tps
    tokens = min(r.n_predict, ours.n_predict + 1) if ours.finish_reason == "stop" else r.n_predict
    return tokens / seconds


def bench_heads(args, ks: list[int]) -> None:
    """The four draft heads on the same files and k as native llama-speculative-simple: the
    tiny random-weight models of head_models.py (or -m/-md/--spec-type), where the decode
    is cheap and what differs is each engine's work per step around it."""
    import head_models

    from specli.plan import load

    bin_dir = native.native_bin_dir()
    tmp = Path(tempfile.mkdtemp())
    files = head_models.write_all(tmp / "heads", defaults.smollm2_q4_1())
    cases = ({args.spec_type: (args.spec_type, args.model, args.model_draft)}
             if args.spec_type else
             {label: (t, files[a], files[b] if b else None)
              for label, (t, a, b) in HEADS.items()})
    texts = list((WIDE if args.prompts == "wide" else PROMPTS).values())
    greedy = SamplingParams(temp=0.0)
    tps: dict[tuple[str, int, str], list[float]] = {}
    acc: dict[tuple[str, int, str], list[float]] = {}
    for label, (spec, target, head) in cases.items():
        for k in ks:
            e = load(ModelParams(target, n_threads=args.threads, n_gpu_layers=args.ngl),
                     # the head offloaded as -ngld says, and native's alike (its own default
                     # offloads the draft where there is a GPU)
                     ModelParams(head, n_threads=args.threads, n_gpu_layers=args.ngld)
                     if head else None,
                     DraftParams(n_max=k), spec_types=(spec,))
            try:
                for rep in range(args.repeat):
                    for i, text in enumerate(texts):
                        print(f"[{rep + 1}/{args.repeat}] {label} k={k} {i}", file=sys.stderr)
                        e.forget()  # every run evaluates its prompt, as native's does
                        out = e.complete(e.tokenize(text), args.n, greedy)
                        tps.setdefault((label, k, "specli"), []).append(out.stats.decode_tps)
                        acc.setdefault((label, k, "specli"), []).append(out.stats.accept_rate)
                        if bin_dir is None:
                            continue
                        f = tmp / f"p{i}.txt"
                        f.write_text(text + "\n")  # native -f drops one trailing newline
                        r = native.head(bin_dir, target, spec, head, str(f), args.n, k,
                                        args.threads, extra=("-ngl", str(args.ngl),
                                                             "-ngld", str(args.ngld)),
                                        steps=False)
                        tps.setdefault((label, k, "native"), []).append(fair_tps(r, out.stats))
                        acc.setdefault((label, k, "native"), []).append(r.accept_rate)
            finally:
                e.close()
    lines = [f"Machine: {machine()}; threads {args.threads}; -ngl {args.ngl}; -ngld {args.ngld}.",
             "Draft heads on " + ("the given files" if args.spec_type else
                                  "head_models.py's tiny random-weight models") +
             f", greedy, -n {args.n}, {len(texts)} prompts, median of {args.repeat} "
             "interleaved rounds; paired: the median of each specli run's ratio to the "
             "native run right after it.", "",
             "| type | k | specli t/s | native t/s | specli / native | paired | accept specli "
             "| accept native |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for spec in cases:
        for k in ks:
            ours = statistics.median(tps[(spec, k, "specli")])
            theirs = statistics.median(tps.get((spec, k, "native"), [0.0]))
            a = 100 * statistics.mean(acc[(spec, k, "specli")])
            b = 100 * statistics.mean(acc.get((spec, k, "native"), [0.0]))
            ratio = f"{ours / theirs:.2f}x" if theirs else "-"
            # each specli run against the native run right after it (same prompt, same
            # round): the machine's drift between rounds cancels
            pairs = [x / y for x, y in zip(tps[(spec, k, "specli")],
                                           tps.get((spec, k, "native"), []), strict=False)
                     if y]
            paired = f"{statistics.median(pairs):.2f}x" if pairs else "-"
            lines.append(f"| {spec} | {k} | {ours:.1f} | {theirs:.1f} | {ratio} | {paired} "
                         f"| {a:.1f}% | {b:.1f}% |")
    publish(lines, args.write, HEADS_BEGIN, HEADS_END)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="target GGUF (default: SmolLM2 F32 derived)")
    ap.add_argument("-md", "--model-draft", help="draft GGUF (default: SmolLM2 Q4_1)")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--k", default="4,8,16")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-ngl", type=int, default=0)
    ap.add_argument("-ngld", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompts", choices=("default", "wide"), default="default")
    ap.add_argument("--per-prompt", action="store_true",
                    help="also a table per prompt and k: acceptance and ms per step, both engines")
    ap.add_argument("--write", help="replace the results block of this markdown file")
    ap.add_argument("--heads", action="store_true",
                    help="benchmark the draft heads (MTP, EAGLE-3, DFlash, DSpark) instead")
    ap.add_argument("--spec-type", help="with --heads: this head type on -m/-md only")
    args = ap.parse_args()
    if args.heads:
        bench_heads(args, [int(k) for k in args.k.split(",")])
        return

    draft_path = args.model_draft or defaults.smollm2_q4_1()
    target_path = args.model or defaults.derived("f32", draft_path)
    ks = [int(k) for k in args.k.split(",")]
    bin_dir = native.native_bin_dir()
    if bin_dir is None:
        print("no native build (scripts/build_native.sh): native columns skipped", file=sys.stderr)

    tgt = Model(ModelParams(target_path, n_threads=args.threads, n_gpu_layers=args.ngl))
    dft = ModelDraft(Model(ModelParams(draft_path, n_threads=args.threads,
                                       n_gpu_layers=args.ngld)))
    greedy = SamplingParams(temp=0.0)
    tmp = Path(tempfile.mkdtemp())
    prompts = {}
    chosen = WIDE if args.prompts == "wide" else PROMPTS
    for name, text in chosen.items():
        rendered = render_chat(tgt.chat_template(), text)
        (tmp / f"{name}.txt").write_text(rendered + "\n")  # native -f drops one newline
        prompts[name] = tgt.tokenize(rendered)

    tps: dict[str, list[float]] = {}
    extra: dict[str, list[float]] = {}

    # (prompt, k, engine) -> [(accept rate, decode ms per verification step)]
    per: dict[tuple[str, int, str], list[tuple[float, float]]] = {}

    def add(key: str, value: float) -> None:
        tps.setdefault(key, []).append(value)

    gpu = ("-ngl", str(args.ngl), "-ngld", str(args.ngld))
    for rep in range(args.repeat):
        for name, ids in prompts.items():
            print(f"[{rep + 1}/{args.repeat}] {name}", file=sys.stderr)
            plain = Engine(tgt).complete(ids, args.n, greedy, speculative=False)
            add("target alone (specli)", plain.stats.decode_tps)
            for k in ks:
                dft.n_max = k
                out = Engine(tgt, dft, DraftParams(n_max=k)).complete(ids, args.n, greedy)
                s = out.stats
                assert out.tokens == plain.tokens or args.model, "greedy output drifted"
                add(f"specli k={k}", s.decode_tps)
                per.setdefault((name, k, "specli"), []).append(
                    (s.accept_rate, 1e3 * s.t_decode_s / max(s.n_steps, 1)))
                extra.setdefault(f"specli k={k}", []).extend(
                    [s.accept_rate, 1e3 * s.overhead_s / max(s.target.eval_runs, 1),
                     100 * s.overhead_s / s.t_decode_s])
                if bin_dir is None:
                    continue
                f = str(tmp / f"{name}.txt")
                r = native.speculative_simple(bin_dir, target_path, draft_path, f, args.n, k,
                                              args.threads, extra=gpu)
                add(f"native speculative-simple k={k}", fair_tps(r, s))
                extra.setdefault(f"native speculative-simple k={k}", []).append(r.accept_rate)
                r = native.speculative(bin_dir, target_path, draft_path, f, args.n, k,
                                       args.threads, extra=gpu)
                add(f"native speculative k={k}", fair_tps(r, s))
                steps = -(-r.n_drafted // k)  # llama-speculative drafts k per step (no p_min)
                per.setdefault((name, k, "native"), []).append(
                    (r.accept_rate, 1e3 * r.n_predict / r.decode_tps / max(steps, 1)
                     if r.decode_tps else 0.0))
                extra.setdefault(f"native speculative k={k}", []).append(r.accept_rate)

    base = statistics.median(tps["target alone (specli)"])
    lines = [
        f"Machine: {machine()}; threads {args.threads}; -ngl {args.ngl} -ngld {args.ngld}.",
        f"Target `{Path(target_path).name}`, draft `{Path(draft_path).name}`, greedy, "
        f"-n {args.n}, prompts: {', '.join(chosen)} (chat template), median of "
        f"{args.repeat} interleaved rounds. Native speeds count the tokens actually output "
        "(native counters include accepted tokens past end-of-generation; see fair_tps).",
        "",
        "| configuration | decode t/s | vs target alone | accept "
        "| overhead ms/step (% of decode) |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, values in tps.items():
        med = statistics.median(values)
        e = extra.get(key, [])
        acc = f"{100 * statistics.mean(e[0::3] if key.startswith('specli') else e):.1f}%" \
            if e else "-"
        ovh = (f"{statistics.mean(e[1::3]):.2f} ({statistics.mean(e[2::3]):.1f}%)"
               if key.startswith("specli") else "-")
        lines.append(f"| {key} | {med:.1f} | {med / base:.2f}x | {acc} | {ovh} |")
    if bin_dir is not None:
        lines += ["", "| k | specli / native speculative-simple | specli / native speculative |",
                  "|---:|---:|---:|"]
        for k in ks:
            ours = statistics.median(tps[f"specli k={k}"])
            simple = statistics.median(tps[f"native speculative-simple k={k}"])
            spec = statistics.median(tps[f"native speculative k={k}"])
            lines.append(f"| {k} | {ours / simple:.2f}x | {ours / spec:.2f}x |")
    if args.per_prompt and bin_dir is not None:
        lines += ["", "Per prompt (median over rounds): acceptance, and decode time per "
                  "verification step, which does not depend on how much was accepted.", "",
                  "| prompt | k | accept specli | accept native | ms/step specli "
                  "| ms/step native | specli / native per step |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        ratios = {k: [] for k in ks}
        for name in chosen:
            for k in ks:
                a = per.get((name, k, "specli"), [])
                b = per.get((name, k, "native"), [])
                if not a or not b:
                    continue
                acc_a = statistics.median(x[0] for x in a)
                acc_b = statistics.median(x[0] for x in b)
                ms_a = statistics.median(x[1] for x in a)
                ms_b = statistics.median(x[1] for x in b)
                ratios[k].append(ms_b / ms_a if ms_a else 0.0)
                lines.append(f"| {name} | {k} | {100 * acc_a:.1f}% | {100 * acc_b:.1f}% "
                             f"| {ms_a:.2f} | {ms_b:.2f} | {ms_b / ms_a:.2f}x |")
        for k in ks:
            if ratios[k]:
                lines.append(f"| all (median) | {k} | | | | | "
                             f"{statistics.median(ratios[k]):.2f}x |")
    publish(lines, args.write, BEGIN, END)


if __name__ == "__main__":
    main()
