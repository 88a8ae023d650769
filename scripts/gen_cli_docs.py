"""Write docs/cli.md from the commands' --help (tests/test_docs.py keeps it fresh).

    python scripts/gen_cli_docs.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
COMMANDS = [[], ["run"], ["serve"], ["download"], ["tune-draft"], ["check-pair"], ["info"],
            ["audit"],
            ["lookup"],
            ["lookup", "create"],
            ["lookup", "merge"], ["lookup", "stats"]]


def help_text(args: list[str]) -> str:
    env = {**os.environ, "COLUMNS": "100", "TERM": "dumb", "NO_COLOR": "1"}
    env.pop("FORCE_COLOR", None)
    r = subprocess.run([sys.executable, "-m", "specli", *args, "--help"], capture_output=True,
                       text=True, env=env, check=True)
    return "\n".join(line.rstrip() for line in r.stdout.strip().splitlines())


def render() -> str:
    parts = ["# specli command line", "",
             "Generated from `--help` by `scripts/gen_cli_docs.py`; a test keeps it current.", ""]
    for args in COMMANDS:
        parts += [f"## `{' '.join(['specli', *args])}`",
                  "", "```", help_text(args), "```", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    (ROOT / "docs" / "cli.md").write_text(render())
