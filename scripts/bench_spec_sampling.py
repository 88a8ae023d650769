"""Exact vs rejection verification of sampled drafts (--spec-sampling), in one run.

    python scripts/bench_spec_sampling.py [--target f32|f16] [--seeds 3] [-n 128]

The embedded pair (the SmolLM2 Q4_1 drafting for an F32 or F16 target), --draft 8, three
chat prompts; for each temperature, the target alone and each mode on the same
seeds, interleaved; prints acceptance (accepted / drafted), mean acceptance length and the
median decode speed of each, and the speed as a ratio to the target alone. Ratios in one run
on one machine, never absolute promises: run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from specli import defaults  # noqa: E402
from specli.config import DraftParams, ModelParams, SamplingParams  # noqa: E402
from specli.plan import load  # noqa: E402

PROMPTS = ["Explain how a hash map works.", "Write a short story about a lighthouse keeper.",
           "List ten fruits and their colours."]
TEMPS = (0.2, 0.7, 1.0)
MODES = ("exact", "rejection")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="f32", choices=("f32", "f16"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    target = ModelParams(defaults.derived(a.target), n_threads=a.threads)
    draft = ModelParams(defaults.smollm2_q4_1(), n_threads=a.threads)
    engines = {m: load(target, draft, DraftParams(n_max=8, sampling=m)) for m in MODES}
    e0 = engines[MODES[0]]
    prompts = [e0.tokenize(p, chat=True) for p in PROMPTS]
    print("| temp | mode | accepted | mean acceptance length | t/s | vs target alone |")
    print("|---:|---|---:|---:|---:|---:|")
    for temp in TEMPS:
        rows: dict[str, list] = {"alone": [], **{m: [] for m in MODES}}
        for seed in range(a.seeds):
            for prompt in prompts:
                sp = SamplingParams(temp=temp, seed=seed)
                rows["alone"].append(e0.complete(prompt, a.n, sp, speculative=False).stats)
                for m in MODES:
                    rows[m].append(engines[m].complete(prompt, a.n, sp).stats)
        base = statistics.median(s.decode_tps for s in rows["alone"])
        print(f"| {temp} | target alone | | | {base:.1f} | 1.00x |")
        for m in MODES:
            st = rows[m]
            drafted, acc = sum(s.n_drafted for s in st), sum(s.n_accept for s in st)
            steps = sum(s.n_steps for s in st)
            tps = statistics.median(s.decode_tps for s in st)
            print(f"| {temp} | {m} | {acc / max(drafted, 1):.1%} | {1 + acc / max(steps, 1):.2f} "
                  f"| {tps:.1f} | {tps / base:.2f}x |")
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
