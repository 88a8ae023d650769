"""Write docs/cli.md from the commands' --help (tests/test_docs.py keeps it fresh).

    python scripts/gen_cli_docs.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
COMMANDS = [[], ["run"], ["serve"], ["download"], ["convert-head"], ["tune-draft"],
            ["check-pair"], ["info"],
            ["audit"],
            ["lookup"],
            ["lookup", "create"],
            ["lookup", "merge"], ["lookup", "stats"]]


def help_texts() -> list[str]:
    """Every command's `--help`, as `specli ARGS --help` prints it into a pipe 100 columns
    wide with no colour: all of them from one new interpreter (a second each, twelve times,
    when each had its own)."""
    env = {**os.environ, "COLUMNS": "100", "TERM": "dumb", "NO_COLOR": "1"}
    env.pop("FORCE_COLOR", None)
    r = subprocess.run([sys.executable, __file__, "--help-texts"], capture_output=True,
                       text=True, env=env, check=True)
    return json.loads(r.stdout)


def _help_texts() -> list[str]:
    """In that interpreter: each command's help, as the console entry point prints it."""
    from specli.cli.app import app

    out = []
    for args in COMMANDS:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                app([*args, "--help"], prog_name="specli")
            except SystemExit as e:
                if e.code:
                    raise
        out.append("\n".join(line.rstrip() for line in buf.getvalue().strip().splitlines()))
    return out


def render() -> str:
    parts = ["# specli command line", "",
             "Generated from `--help` by `scripts/gen_cli_docs.py`; a test keeps it current.", ""]
    for args, text in zip(COMMANDS, help_texts(), strict=True):
        parts += [f"## `{' '.join(['specli', *args])}`",
                  "", "```", text, "```", ""]
    return "\n".join(parts)


if __name__ == "__main__" and sys.argv[1:] == ["--help-texts"]:
    print(json.dumps(_help_texts()))
elif __name__ == "__main__":
    (ROOT / "docs" / "cli.md").write_text(render())
