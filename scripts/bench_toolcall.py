"""How long reading a streamed answer takes, per tool-call family, on long and hostile answers.

    python scripts/bench_toolcall.py [--chars 16000 64000] [--piece 4]

`specli serve` reads a streamed answer as each piece arrives (toolstream.Splitter, which keeps
its place: the total should grow linearly with the answer). Each answer here is either what
models write at length (code as text, a call whose argument is a long file, a long GPT-OSS
answer) or what a model may be led to write (openers without closers, nesting, a JSON answer
under way, markers on one long line); the table is the worst family's total seconds for the
whole stream, fed `--piece` characters at a time, at each length, and the last column the
ratio of the longest to the shortest (4x the characters: linear reading gives about 4).
Everything runs in this process: no model, no server.
"""

from __future__ import annotations

import argparse
import json
import time

from specli import toolcall as tc
from specli.toolstream import Splitter

TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object"}}}]


def answers(n: int) -> dict[str, str]:
    ds = tc.DS_CALL + "function" + tc.DS_SEP
    code = json.dumps("def f(x):\n    return x < 3 and [x, {'a': 1}]\n" * (n // 45))
    return {
        "a call with a long argument": f'<tool_call>{{"name": "edit", "arguments": '
                                        f'{{"text": {code}}}}}</tool_call>',
        "a long GPT-OSS answer": "<|channel|>final<|message|>" + "Some words, and more. " * (
            n // 22),
        "plain code": "def f(x):\n    return x < 3 and [x, {'a': 1}]\n" * (n // 45),
        "[ repeated": "[" * n,
        "unclosed objects": '{"a":' * (n // 5),
        "<tool_call>{ repeated": '<tool_call>{"name": "edit", "arguments": {' * (n // 42),
        "[TOOL_CALLS][ repeated": "[TOOL_CALLS][" * (n // 13),
        "<function= repeated": "<function=" * (n // 10),
        "<function= then a long name": "<function=" + "a" * n,
        "<|tool_call>call:x{ repeated": "<|tool_call>call:x{" * (n // 19),
        "deepseek call openers": ds * (n // 20),
        "harmony messages": "<|channel|>analysis<|message|>" * (n // 30),
        "a JSON response under way": '{"response": "' + "ab\\n" * (n // 4),
        "<think> repeated": "<think>" * (n // 7),
    }


def _worst(text: str, piece: int, fams: dict) -> tuple[float, str]:
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    worst = (0.0, "")
    for name, fam in fams.items():
        s = Splitter(fam, TOOLS)
        t0 = time.perf_counter()
        for p in pieces:
            s.feed(p)
        s.finish()
        worst = max(worst, (time.perf_counter() - t0, name))
    return worst


def hop(text: str, piece: int, fam) -> tuple[float, float]:
    """Microseconds a piece: the stream read on the event loop, and the same read handed to
    a thread and awaited (what moving it off the loop would cost)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    s = Splitter(fam, TOOLS, False, "deepseek", True)
    t0 = time.perf_counter()
    for p in pieces:
        s.feed(p)
    here = (time.perf_counter() - t0) / len(pieces)

    async def away() -> float:
        loop, pool = asyncio.get_running_loop(), ThreadPoolExecutor(1)
        s = Splitter(fam, TOOLS, False, "deepseek", True)
        t0 = time.perf_counter()
        for p in pieces:
            await loop.run_in_executor(pool, s.feed, p)
        pool.shutdown()
        return (time.perf_counter() - t0) / len(pieces)

    return here * 1e6, asyncio.run(away()) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chars", type=int, nargs="+", default=[16000, 64000])
    ap.add_argument("--piece", type=int, default=4)
    ap.add_argument("--hop", action="store_true", help="Only the event loop's share: a "
                    "piece read on the loop, against the same read handed to a thread.")
    a = ap.parse_args()
    if a.hop:
        fam = next(f for _, f in tc.FAMILIES if f.name == "hermes")
        text = answers(a.chars[0])["a call with a long argument"]
        here, away = hop(text, a.piece, fam)
        print(f"{len(text)} characters, {a.piece} a piece (Hermes): {here:.1f} us a piece on "
              f"the event loop, {away:.1f} us through a thread")
        return
    fams = {f.name: f for _, f in tc.FAMILIES} | {"generic": tc.GENERIC}
    sizes = sorted(a.chars)
    print(f"| answer ({a.piece} characters a piece) | worst family | "
          + " | ".join(f"{n} chars, s" for n in sizes) + " | ratio |")
    print("|---|---|" + "---:|" * (len(sizes) + 1))
    for what in answers(sizes[0]):
        got = [_worst(answers(n)[what], a.piece, fams) for n in sizes]
        ratio = got[-1][0] / max(got[0][0], 1e-9)
        print(f"| {what} | {got[-1][1]} | " + " | ".join(f"{t:.3f}" for t, _ in got)
              + f" | {ratio:.1f} |")


if __name__ == "__main__":
    main()
