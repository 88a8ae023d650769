"""Where a speculative step's time goes: inside each model's llama_decode, or around it.

    python scripts/profile_step.py -m TARGET.gguf -md DRAFT.gguf [-ngl 99 -ngld 99] [-t 8]

For the target alone and each k: decode t/s, decodes per step and milliseconds per decode for
each model, and the time outside llama_decode per step (Python, sampling, cache bookkeeping).
`--raw` adds the floor: the same one-token decodes from a bare ctypes loop (llama_decode,
llama_synchronize, argmax over the logits), as llama-bench's tg test does them. `--no-split`
repeats each k with an offloaded draft fed its two pending tokens in one decode, as on a CPU,
to see what a change of batch shape costs a GPU (ggml-cuda re-captures its CUDA graph).
Greedy; speeds are for comparing configurations in one run, not absolute promises.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from specli import backend, defaults  # noqa: E402  (llama.cpp's libraries first)
from specli.config import DraftPolicy, ModelParams, SamplingParams  # noqa: E402
from specli.drafts import ModelDraft  # noqa: E402
from specli.engine import Engine  # noqa: E402
from specli.template_host import render_chat  # noqa: E402


def raw_floor(model: backend.Model, prompt: list[int], n: int) -> float:
    """Tokens per second of bare one-token decodes with an argmax each (no engine)."""
    import numpy as np

    model.rewind(0)
    row = model.decode(prompt, logits="last")[0]
    t0 = time.perf_counter()
    for _ in range(n):
        row = model.decode([int(np.argmax(row))], logits="last")[0]
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("-md", "--model-draft")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--k", default="4,8,16")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-ngl", type=int, default=0)
    ap.add_argument("-ngld", type=int, default=0)
    ap.add_argument("--raw", action="store_true")
    ap.add_argument("--no-split", action="store_true")
    args = ap.parse_args()
    draft_path = args.model_draft or defaults.smollm2_q4_1()
    target_path = args.model or defaults.derived("f32", draft_path)
    tgt = backend.Model(ModelParams(target_path, n_threads=args.threads, n_gpu_layers=args.ngl))
    dft = ModelDraft(backend.Model(ModelParams(draft_path, n_threads=args.threads,
                                               n_gpu_layers=args.ngld)))
    prompt = tgt.tokenize(render_chat(tgt.chat_template(), "Write a binary search in Python"))
    greedy = SamplingParams(temp=0.0)
    runs = [("target alone", 0, True)]
    for k in (int(k) for k in args.k.split(",")):
        runs.append((f"k={k}", k, True))
        if args.no_split and dft.model.offloaded:
            runs.append((f"k={k} no split", k, False))
    print("| run | t/s | steps | target ms/decode | draft decodes/step | draft ms/decode "
          "| outside decode ms/step | accept |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, k, split in runs:
        dft.model.offloaded = split and dft.model.offloaded
        engine = Engine(tgt, dft if k else None, DraftPolicy(n_max=max(k, 1)))
        engine.complete(prompt, 32, greedy, speculative=bool(k))  # warm up (graphs, caches)
        s = engine.complete(prompt, args.n, greedy, speculative=bool(k)).stats
        steps = max(s.target.eval_runs, 1)
        d = s.draft
        print(f"| {name} | {s.decode_tps:.1f} | {steps} | {s.target.eval_ms / steps:.3f} | "
              f"{(d.eval_runs / steps) if d else 0:.2f} | "
              f"{(d.eval_ms / max(d.eval_runs, 1)) if d else 0:.3f} | "
              f"{1e3 * s.overhead_s / steps:.3f} | {100 * s.accept_rate:.1f}% |", flush=True)
        dft.model.offloaded = backend.local_gpu() and args.ngld != 0
    if args.raw:
        for label, m in (("target", tgt), ("draft", dft.model)):
            print(f"raw one-token decode loop, {label}: {raw_floor(m, prompt, args.n):.1f} t/s")


if __name__ == "__main__":
    main()
