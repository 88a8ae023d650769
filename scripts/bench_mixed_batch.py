"""What a server's combined decode costs when its slots' tokens differ in number (issue 56).

8 slots of one shared context (batching.SharedContext), each holding 100 tokens, decode
k_i + 1 tokens each in one batch, as the loop combines them; the median of 15 decodes for
each mix. With a cache stream a sequence, llama.cpp splits unequal lengths into several
graph runs. `python scripts/bench_mixed_batch.py [target|draft] [-t THREADS]`."""

from __future__ import annotations

import argparse
import time
from concurrent import futures

import numpy as np

from specli import defaults
from specli.batching import SharedContext
from specli.config import ModelParams

MIXES = ([0] * 8, [1] * 8, [2] * 8, [2, 2, 2, 2, 0, 0, 0, 0], [1, 0] * 4, [8] * 8,
         [8] + [0] * 7)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("which", nargs="?", default="target", choices=("target", "draft"))
    ap.add_argument("-t", type=int, default=2)
    args = ap.parse_args()
    target, draft = defaults.default_pair()
    ctx = SharedContext(ModelParams(target if args.which == "target" else draft, n_ctx=512,
                                    n_threads=args.t), n_seq=8)
    views = [ctx.view(i) for i in range(8)]
    prompt = list(range(1000, 1100))

    def all_slots(work) -> None:  # as the server's slots: tasks of the loop, decodes combined
        futures.wait(ctx.sched.submit_all([lambda i=i: work(i) for i in range(8)]))

    all_slots(lambda i: views[i].decode(prompt))
    try:
        for ks in MIXES:
            times = []
            for _ in range(15):
                t0 = time.perf_counter()
                all_slots(lambda i, ks=ks: views[i].decode(list(range(5, 6 + ks[i])),
                                                           logits="all"))
                times.append(time.perf_counter() - t0)
                for v in views:
                    v.rewind(len(prompt))
            print(f"{ks}: {sum(k + 1 for k in ks)} tokens, {np.median(times) * 1000:.1f} ms")
    finally:
        ctx.close()


if __name__ == "__main__":
    main()
