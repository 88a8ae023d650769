"""The two Rich consoles: generated text and JSON on stdout, everything else on stderr."""

from __future__ import annotations

from rich.console import Console

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
