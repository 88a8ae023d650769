"""docs/cli.md is the --help text; the README names the test command CI runs."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_cli_docs  # noqa: E402


def test_cli_docs_match_help():
    assert (ROOT / "docs" / "cli.md").read_text() == gen_cli_docs.render(), \
        "docs/cli.md is stale: run python scripts/gen_cli_docs.py"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest" in readme and "\npython -m pytest\n" in ci


def _flags_by_name() -> dict[str, tuple[str, ...]]:
    """Every flag of every command, by each of its spellings: the values --help shows for it
    (a metavar's alternatives, or a choice's)."""
    from specli.cli.app import _command

    out: dict[str, tuple[str, ...]] = {}
    for cmd in _command().commands.values():
        for sub in [cmd, *getattr(cmd, "commands", {}).values()]:
            for p in sub.params:
                if p.param_type_name != "option":  # (Typer's own Click: by its name)
                    continue
                if p.metavar:
                    shown = tuple(p.metavar.split("|"))
                elif getattr(p.type, "choices", None):
                    shown = tuple(p.type.choices)
                else:
                    shown = ()
                for name in (*p.opts, *p.secondary_opts):
                    out.setdefault(name, shown)
    return out


def test_the_readmes_flag_tables_say_what_help_says():
    """One truth (issue 59): a README table cell that writes a flag with its values (`-ngl
    N|auto|all`, `-sm none|layer|row|tensor`) says what --help says of it, and every flag the
    README's tables name exists."""
    import re

    flags = _flags_by_name()
    cells = re.findall(r"^\| (`-.*?) \|", (ROOT / "README.md").read_text(), re.M)
    assert cells
    checked = 0
    for cell in cells:
        for flag, value in re.findall(r"`(-[\w-]+)((?: [^`]+)?)`", cell.replace("\\|", "|")):
            assert flag in flags, f"README names {flag}, which no command has"
            shown = flags[flag]
            if value.strip() and "|" in value:  # the values it may take, spelled out
                assert tuple(value.strip().split("|")) == shown, (flag, value, shown)
                checked += 1
    assert checked >= 2  # -ngl's and -sm's at least
    readme = (ROOT / "README.md").read_text()
    assert "`-ngl` takes a number, `auto` or `all`" in readme  # the prose says so too
    assert flags["-ngl"] == ("N", "auto", "all")
