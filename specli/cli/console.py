"""The two Rich consoles: generated text and JSON on stdout, everything else on stderr."""

from __future__ import annotations

import errno
import io
import os
import sys
from contextlib import nullcontext

from rich.console import Console

# NO_COLOR (no-color.org): no escapes at all. Rich's own reading of it drops colours but
# keeps bold and dim; a terminal that asked for plain text gets plain text.
_PLAIN = {"color_system": None} if os.environ.get("NO_COLOR") else {}
out = Console(highlight=False, soft_wrap=True, **_PLAIN)
err = Console(stderr=True, highlight=False, soft_wrap=True, **_PLAIN)
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


class OutputError(OSError):
    """A write to stdout failed (its reader gone, a full disk...): raised by the stdout that
    main() installs, so that the error boundary knows the error is the output's."""


class _Raw(io.FileIO):
    def write(self, b) -> int:
        try:
            return super().write(b)
        except OSError as e:
            raise OutputError(e.errno, e.strerror) from None


def marked_stdout():
    """sys.stdout again, over the same descriptor, its write errors marked as OutputError;
    a ClosedOutput where it is closed (`>&-`)."""
    old = sys.stdout
    if old is None:
        return ClosedOutput()
    try:
        fd = old.fileno()
        old.flush()
    except (OSError, ValueError, AttributeError):  # not a real descriptor (a test's capture)
        return old
    return io.TextIOWrapper(io.BufferedWriter(_Raw(fd, "w", closefd=False)),
                            encoding=old.encoding, errors=old.errors, newline="\n",
                            line_buffering=old.line_buffering)


class ClosedOutput(io.TextIOBase):
    """sys.stdout for a process started with it closed (`>&-`): a write fails with EBADF,
    which the error boundary turns into one line."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OutputError(errno.EBADF, "standard output is closed")


def check_output() -> None:
    """Before long work whose result goes to stdout: refuse a closed stdout at once."""
    if isinstance(sys.stdout, ClosedOutput):
        raise OutputError(errno.EBADF, "standard output is closed")


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
