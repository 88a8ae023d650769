"""The Typer app and its one error boundary."""

from __future__ import annotations

import errno
import functools
import os
import re
import sys

import typer

from specli import __version__
from specli.cli import audit as audit_cmd
from specli.cli import check_pair as check_pair_cmd
from specli.cli import console
from specli.cli import download as download_cmd
from specli.cli import info as info_cmd
from specli.cli import lookup as lookup_cmd
from specli.cli import rpc_server as rpc_server_cmd
from specli.cli import run as run_cmd
from specli.cli import serve as serve_cmd
from specli.cli import tune as tune_cmd
from specli.cli.console import err
from specli.errors import SpecliError

app = typer.Typer(
    name="specli",
    help="Speculative decoding of local GGUF models, on llama.cpp.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
    rich_markup_mode=None,  # plain help: every flag spelled in full, wrapped at any width
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("run")(run_cmd.run)
app.command("serve")(serve_cmd.serve)
app.command("check-pair")(check_pair_cmd.check_pair)
app.command("info")(info_cmd.info)
app.command("download")(download_cmd.download)
app.command("tune-draft")(tune_cmd.tune_draft)
app.command("audit")(audit_cmd.audit)
app.command("rpc-server")(rpc_server_cmd.rpc_server)
app.add_typer(lookup_cmd.app, name="lookup")


def _version(value: bool) -> None:
    if value:
        print(f"specli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Speculative decoding of local GGUF models, on llama.cpp."""


@functools.cache
def _command():
    """The app as Click's command, built once per process: Typer builds it anew from every
    command's signature on each call (50 ms), which `specli` pays once anyway but a process
    that runs several commands (tests, scripts/gen_cli_docs.py) would pay each time."""
    return typer.main.get_command(app)


def main() -> None:
    """Console entry point: every error, Click's usage errors included, is one line on stderr
    and its exit code (2 for a usage error)."""
    sys.stdout = console.marked_stdout()  # its write errors known as the output's
    if sys.stderr is None:  # 2>&-: what would have gone there goes nowhere
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process
    try:
        try:
            rc = _command().main(prog_name="specli", standalone_mode=False)
        except SystemExit as e:  # Click turns EPIPE into a silent exit 1 even so
            if isinstance(e.__context__, console.OutputError):
                raise e.__context__ from None
            raise
        sys.stdout.flush()  # here, not at exit: a full disk is one line too
    except console.OutputError as e:
        console.discard_output()
        if e.errno == errno.EPIPE:  # specli ... | head: end quietly, as SIGPIPE would
            sys.exit(141)
        err.print(f"error: cannot write the output: {e.strerror}", markup=False,
                  soft_wrap=True)
        sys.exit(2)
    except OSError as e:  # any other I/O failure that reached here: one line, not a trace
        if os.environ.get("SPECLI_DEBUG") == "1":
            raise
        where = f": {e.filename}" if e.filename else ""
        err.print(f"error: {e.strerror or e}{where}", markup=False, soft_wrap=True)
        sys.exit(2)
    except SpecliError as e:
        if os.environ.get("SPECLI_DEBUG") == "1":
            raise
        hint = f" (hint: {e.hint})" if e.hint else ""
        err.print(f"error: {e.message}{hint}", markup=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except Exception as e:
        # Click's errors (Typer's own copy of Click, or Click): by their protocol, not their
        # module, which Typer's public API does not name
        code = getattr(e, "exit_code", None)
        if not hasattr(e, "format_message") or not isinstance(code, int):
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # `specli` alone: the help, as before
            print(e.format_message())
        else:
            err.print(f"error: {usage_line(e)}", markup=False, soft_wrap=True)
        sys.exit(code)
    sys.exit(rc if isinstance(rc, int) else 0)


def _plain(text: str) -> str:
    """One line, first letter small, pydantic's prefix dropped."""
    text = " ".join(str(text).replace("Value error, ", "").split())
    return text[:1].lower() + text[1:]


def usage_line(e: Exception) -> str:
    """A Click error as one line in specli's words: `no such option --draf (did you mean
    --draft?)`, `invalid value for -fa/--flash-attn: 'maybe' is not one of ...`,
    `-p needs a value`."""
    name = type(e).__name__
    message = getattr(e, "message", "") or ""
    if name == "NoSuchOption":
        maybe = getattr(e, "possibilities", None) or []
        return f"no such option {getattr(e, 'option_name', '?')}" + (
            f" (did you mean {' or '.join(maybe[:3])}?)" if maybe else "")
    param = getattr(e, "param", None)
    if param is not None:
        names = "/".join(getattr(param, "opts", None) or [param.name or "?"])
        if name == "MissingParameter":
            if getattr(param, "param_type_name", "") == "argument":
                return f"missing argument {(param.name or '?').upper()}"
            return f"missing {names}"
        return f"invalid value for {names}" + (f": {_plain(message)}" if message else "")
    m = re.fullmatch(r"Option '(.+)' requires an argument\.", message)
    if m:
        return f"{m.group(1)} needs a value"
    return _plain(e.format_message()).rstrip(".")
