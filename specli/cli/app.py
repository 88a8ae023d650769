"""The Typer app and its one error boundary."""

from __future__ import annotations

import difflib
import errno
import functools
import importlib
import os
import re
import sys

import typer

from specli import __version__
from specli.cli import console
from specli.cli.console import err
from specli.errors import SpecliError, UsageError

# each command: (its module, the Typer command or sub-app there), in the help's order
COMMANDS = {
    "run": ("run", "run"),
    "serve": ("serve", "serve"),
    "check-pair": ("check_pair", "check_pair"),
    "info": ("info", "info"),
    "download": ("download", "download"),
    "convert-head": ("convert_head", "convert_head"),
    "tune-draft": ("tune", "tune_draft"),
    "audit": ("audit", "audit"),
    "rpc-server": ("rpc_server", "rpc_server"),
    "lookup": ("lookup", "app"),
}


def _version(value: bool) -> None:
    if value:
        print(f"specli {__version__}")
        raise typer.Exit()


def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Speculative decoding of local GGUF models, on llama.cpp."""


def build(only: str | None = None) -> typer.Typer:
    """The Typer app: every command, or only the one named (what `specli NAME ...` runs:
    the other commands' modules are never imported, nor their options built)."""
    new = typer.Typer(
        name="specli",
        help="Speculative decoding of local GGUF models, on llama.cpp.",
        no_args_is_help=True,
        pretty_exceptions_show_locals=False,
        add_completion=False,
        rich_markup_mode=None,  # plain help: every flag spelled in full, wrapped at any width
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    new.callback()(_root)
    for name, (module, attr) in COMMANDS.items():
        if only in (None, name):
            what = getattr(importlib.import_module(f"specli.cli.{module}"), attr)
            if isinstance(what, typer.Typer):
                new.add_typer(what, name=name)
            else:
                new.command(name)(what)
    return new


@functools.cache
def whole() -> typer.Typer:
    return build()


def __getattr__(name: str):
    if name == "app":  # `app`, the whole app (tests, scripts/gen_cli_docs.py), when asked for
        return whole()
    raise AttributeError(name)


def _selected(args: list[str]) -> str | None:
    """The command args name first, if it is one (else the whole app: the root's help, a
    mistyped name's suggestions)."""
    return args[0] if args and args[0] in COMMANDS else None


def _command(only: str | None = None):
    """The app (or its one command's) as Click's command, built once per process: Typer
    builds it anew from every command's signature on each call (50 ms for them all), which
    `specli` pays once anyway but a process that runs several commands (tests,
    scripts/gen_cli_docs.py) would pay each time."""
    return _click(only)  # one cache key for _command() and _command(None)


@functools.cache
def _click(only: str | None):
    return typer.main.get_command(whole() if only is None else build(only))


def whole_words(args: list[str], command=None) -> None:
    """UsageError for a single-dash spelling the command does not have, before Click sees
    it: Click splits `-ps` into `-p s` and `-nkvo` into `-n kvo`, and llama.cpp, whose flags
    these are, reads every spelling as a whole word."""
    cmd, i = _subcommand(args, command)
    if cmd is None:
        return  # Click names a command it does not know
    takes: dict[str, int] = {}  # spelling -> how many values follow it
    for p in getattr(cmd, "params", ()):
        n = 0 if getattr(p, "is_flag", False) or getattr(p, "count", False) else p.nargs
        for name in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ())):
            if name.startswith("-"):
                takes[name] = n
    for name in ("-h", "--help"):
        takes.setdefault(name, 0)
    while i < len(args):
        a, i = args[i], i + 1
        if a == "--":
            return
        if not a.startswith("-") or len(a) < 2:
            continue
        name = a.split("=", 1)[0] if a.startswith("--") else a
        if name in takes:
            i += takes[name] if "=" not in a else 0
        elif not a.startswith("--") and len(a) > 2 and not _number(a):
            near = difflib.get_close_matches(a, takes, n=3, cutoff=0.6)
            raise UsageError(f"no such option {a}" + (
                f" (did you mean {' or '.join(near)}?)" if near else ""))


def _subcommand(args: list[str], command=None):
    """(the Click command args name, the index of its first argument); None for a name the
    app does not have."""
    cmd, i = command or _command(_selected(args)), 0
    while i < len(args) and not args[i].startswith("-"):
        cmd, i = (getattr(cmd, "commands", None) or {}).get(args[i]), i + 1
        if cmd is None:
            return None, i
    return cmd, i


def name_environment(message: str, args: list[str]) -> str:
    """The message with each flag whose value came from an environment variable (the user
    typed none of its spellings) named as that variable: `LLAMA_ARG_CTX_SIZE (-c/--ctx-size)
    must be at least 16`, not a flag the user never typed."""
    cmd, _ = _subcommand(args)
    typed = {a.split("=", 1)[0] for a in args}
    for p in getattr(cmd, "params", ()) if cmd is not None else ():
        spellings = [*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ())]
        env = getattr(p, "envvar", None) or ()
        var = next((v for v in ([env] if isinstance(env, str) else env) if os.environ.get(v)),
                   None)
        names = "/".join(getattr(p, "opts", ()))
        if var and names and names in message and not typed.intersection(spellings):
            message = message.replace(names, f"{var} ({names})", 1)
    return message


def _number(a: str) -> bool:
    try:
        float(a)
    except ValueError:
        return False
    return True


def main() -> None:
    """Console entry point: every error, Click's usage errors included, is one line on stderr
    and its exit code (2 for a usage error)."""
    sys.stdout = console.marked_stdout()  # its write errors known as the output's
    if sys.stderr is None:  # 2>&-: what would have gone there goes nowhere
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process
    try:
        try:
            whole_words(sys.argv[1:])
            rc = _command(_selected(sys.argv[1:])).main(prog_name="specli",
                                                        standalone_mode=False)
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
        message = name_environment(e.message, sys.argv[1:])
        err.print(f"error: {message}{hint}", markup=False, soft_wrap=True)
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


def _from_environment(e: Exception, param) -> str | None:
    """`LLAMA_ARG_CTX_SIZE (-c/--ctx-size)` when the bad value came from that variable, not
    the command line (the user typed no -c)."""
    ctx, envvar = getattr(e, "ctx", None), getattr(param, "envvar", None)
    source = ctx.get_parameter_source(param.name) if ctx is not None and param.name else None
    if getattr(source, "name", "") != "ENVIRONMENT" or not envvar:
        return None
    names = [envvar] if isinstance(envvar, str) else list(envvar)
    var = next((v for v in names if os.environ.get(v)), names[0])
    return f"{var} ({'/'.join(getattr(param, 'opts', None) or [param.name])})"


# llama.cpp flags specli leaves out on purpose, and why (docs/server-suite.md)
_SYNTH = ("llama.cpp's synthetic acceptance accepts drafts by a given rate whatever the "
          "target says (benchmarking only: its text 'is not valid'); specli's output is "
          "always the target's: measure a real pair with `specli tune-draft`")
_TOOLS = ("llama-server's built-in tools and MCP servers act on this machine (files, shell, "
          "programs) for any caller; specli serves no tools of its own: a client runs its "
          "tools itself")
NOT_OFFERED = {
    "--spec-synth-rates": _SYNTH, "--spec-synth-len": _SYNTH,
    "--tools": _TOOLS, "--tools-runtime": _TOOLS, "--mcp-servers-config": _TOOLS,
    "--mcp-servers-json": _TOOLS, "--ui-mcp-proxy": _TOOLS,
    "--sleep-idle-seconds": "specli does not unload its models when idle: a server keeps "
    "the pair it loaded (stop it to free the memory)",
}


def usage_line(e: Exception) -> str:
    """A Click error as one line in specli's words: `no such option --draf (did you mean
    --draft?)`, `invalid value for -fa/--flash-attn: 'maybe' is not one of ...`,
    `-p needs a value`."""
    name = type(e).__name__
    message = getattr(e, "message", "") or ""
    if name == "NoSuchOption":
        option = getattr(e, "option_name", "?")
        if option in NOT_OFFERED:
            return f"no such option {option}: {NOT_OFFERED[option]}"
        maybe = getattr(e, "possibilities", None) or []
        return f"no such option {option}" + (
            f" (did you mean {' or '.join(maybe[:3])}?)" if maybe else "")
    param = getattr(e, "param", None)
    if param is not None:
        names = "/".join(getattr(param, "opts", None) or [param.name or "?"])
        if name == "MissingParameter":
            if getattr(param, "param_type_name", "") == "argument":
                return f"missing argument {(param.name or '?').upper()}"
            return f"missing {names}"
        where = _from_environment(e, param)
        return f"invalid value for {where or names}" + (f": {_plain(message)}" if message else "")
    m = re.fullmatch(r"Option '(.+)' requires an argument\.", message)
    if m:
        return f"{m.group(1)} needs a value"
    return _plain(e.format_message()).rstrip(".")
