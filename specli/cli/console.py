"""The two Rich consoles: generated text and JSON on stdout, everything else on stderr."""

from __future__ import annotations

import os
from contextlib import nullcontext

from rich.console import Console

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
if not out.is_terminal and "COLUMNS" not in os.environ:
    # into a file or a pipe, a table is as wide as its cells: Rich's 80 columns would cut
    # tune-draft's labels and figures to "…"
    out.width = 400


def spinner(message: str, quiet: bool = False):
    """A spinner on stderr while something slow happens, only on a terminal; `as` gives the
    Rich Status (to update) or None."""
    if quiet or not err.is_terminal:
        return nullcontext()
    return err.status(message)


def safe(text: str) -> str:
    """A file's own strings, shown with control characters escaped: metadata must not move
    the cursor or retitle the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
