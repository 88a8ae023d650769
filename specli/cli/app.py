"""The Typer app and its one error boundary."""

from __future__ import annotations

import os
import sys

import typer

from specli import __version__
from specli.cli import audit as audit_cmd
from specli.cli import check_pair as check_pair_cmd
from specli.cli import download as download_cmd
from specli.cli import info as info_cmd
from specli.cli import lookup as lookup_cmd
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
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("run")(run_cmd.run)
app.command("serve")(serve_cmd.serve)
app.command("check-pair")(check_pair_cmd.check_pair)
app.command("info")(info_cmd.info)
app.command("download")(download_cmd.download)
app.command("tune-draft")(tune_cmd.tune_draft)
app.command("audit")(audit_cmd.audit)
app.add_typer(lookup_cmd.app, name="lookup")


def _version(value: bool) -> None:
    if value:
        print(f"specli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Speculative decoding of local GGUF models, on llama.cpp."""


def main() -> None:
    """Console entry point: every SpecliError becomes one line on stderr and its exit code."""
    try:
        app(prog_name="specli", standalone_mode=True)
    except SpecliError as e:
        if os.environ.get("SPECLI_DEBUG") == "1":
            raise
        hint = f" (hint: {e.hint})" if e.hint else ""
        err.print(f"error: {e.message}{hint}", markup=False, soft_wrap=True)
        sys.exit(e.exit_code)

