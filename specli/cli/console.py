"""The two Rich consoles: generated text and JSON on stdout, everything else on stderr."""

from __future__ import annotations

import errno
import io
import os
import sys
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


# what a write to stdout fails with when its reader cannot take it: a full disk, a closed or
# bad descriptor, a device error (EPIPE, the reader gone, ends quietly instead)
WRITE_ERRORS = {errno.ENOSPC, errno.EBADF, errno.EIO, errno.EFBIG, errno.EDQUOT, errno.EINVAL}


class ClosedOutput(io.TextIOBase):
    """sys.stdout for a process started with it closed (`>&-`): a write fails with EBADF,
    which the error boundary turns into one line."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed")


def check_output() -> None:
    """Before long work whose result goes to stdout: refuse a closed stdout at once."""
    if isinstance(sys.stdout, ClosedOutput):
        raise OSError(errno.EBADF, "standard output is closed")


def discard_output() -> None:
    """Point stdout at /dev/null, dropping what is buffered: the interpreter's last flush then
    has nowhere to fail."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.close(fd)
    except OSError:
        pass
    if isinstance(sys.stdout, ClosedOutput) or sys.stdout is None:
        return
    try:
        sys.stdout.flush()
    except OSError:
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process
        except OSError:
            pass
