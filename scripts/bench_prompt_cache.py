"""Time to first token on each turn of a chat, with the slot's prompt cache and without it.

    python scripts/bench_prompt_cache.py [-m MODEL.gguf] [--turns 5] [--repeat 3]

One engine (the server's per-slot engine), greedy, a conversation whose every turn adds the
previous answer and a new question: with the cache (`cache_prompt`, llama-server's default)
each turn evaluates only what is new; without it (`cache_prompt: false`: the caches are
emptied first) it evaluates the whole conversation again. Ratios from one run on one machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from specli import defaults  # noqa: E402  (llama.cpp's libraries first)
from specli.backend import Model  # noqa: E402
from specli.config import ModelParams, SamplingParams  # noqa: E402
from specli.engine import Engine  # noqa: E402

QUESTIONS = ["Explain what a hash map is.", "How does it handle collisions?",
             "What is its worst-case lookup time?", "How does Python's dict differ?",
             "Give a one-line summary of all of this."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="target GGUF (default: SmolLM2 Q4_1)")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-n", type=int, default=48, help="tokens answered per turn")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    engine = Engine(Model(ModelParams(args.model or defaults.smollm2_q4_1(), n_ctx=4096,
                                      n_threads=args.threads)))
    sp = SamplingParams(temp=0.0)
    ttft: dict[tuple[bool, int], list[float]] = {}
    sizes: dict[int, int] = {}
    for _ in range(args.repeat):
        for cached in (True, False):
            engine.forget()
            messages: list[dict] = []
            for turn in range(args.turns):
                messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
                ids = engine.tokenize_messages(messages)
                sizes[turn] = len(ids)
                if not cached:
                    engine.forget()
                t0 = time.perf_counter()
                chunks = engine.stream(ids, args.n, sp)
                first, text = None, []
                for chunk in chunks:
                    if first is None:
                        first = time.perf_counter() - t0
                    text.append(chunk.text)
                ttft.setdefault((cached, turn), []).append(first)
                messages.append({"role": "assistant", "content": "".join(text)})
    print("| turn | prompt tokens | time to first token, cache (ms) | without (ms) | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for turn in range(args.turns):
        a = statistics.median(ttft[(True, turn)])
        b = statistics.median(ttft[(False, turn)])
        print(f"| {turn + 1} | {sizes[turn]} | {1e3 * a:.0f} | {1e3 * b:.0f} | {b / a:.1f}x |")


if __name__ == "__main__":
    main()
