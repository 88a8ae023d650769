"""How long reading a streamed answer takes, per tool-call family, on hostile answers.

    python scripts/bench_toolcall.py [--chars 16000] [--piece 4]

`specli serve` reads a streamed answer again as each piece arrives (toolcall.Splitter), so
what one reading costs is paid once per token. Each answer here is what a model may be led
to write (openers without closers, nesting, a JSON answer under way, markers on one long
line); the table is the worst family's total seconds for the whole stream, fed `--piece`
characters at a time. Everything runs in this process: no model, no server.
"""

from __future__ import annotations

import argparse
import time

from specli import toolcall as tc

TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object"}}}]


def answers(n: int) -> dict[str, str]:
    ds = tc.DS_CALL + "function" + tc.DS_SEP
    return {
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chars", type=int, default=16000)
    ap.add_argument("--piece", type=int, default=4)
    a = ap.parse_args()
    fams = {f.name: f for _, f in tc.FAMILIES} | {"generic": tc.GENERIC}
    print(f"| answer ({a.chars} characters, {a.piece} a piece) | worst family | seconds |")
    print("|---|---|---:|")
    for what, text in answers(a.chars).items():
        pieces = [text[i:i + a.piece] for i in range(0, len(text), a.piece)]
        worst = (0.0, "")
        for name, fam in fams.items():
            s = tc.Splitter(fam, TOOLS)
            t0 = time.perf_counter()
            for p in pieces:
                s.feed(p)
            s.finish()
            worst = max(worst, (time.perf_counter() - t0, name))
        print(f"| {what} | {worst[1]} | {worst[0]:.2f} |")


if __name__ == "__main__":
    main()
